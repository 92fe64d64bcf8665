"""The planner's per-fetch cost does not grow with the window ([Note: constant-cost planning]).

Cost is counted, not timed: the number of Python lines executed inside prefetch.py (comprehension and
generator bodies included, each iteration counted) by one steady-state fetch's ``reached`` and ``plan``,
for a window of 2 parameters and one of 500.
"""

import sys

import pytest

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero import prefetch
from deepspeed_zero3.runtime.zero.prefetch import PassPrefetcher
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.trace import PassTrace
from zero_fakes import zmodule, zparam

MODULES = 1200
UNLIMITED = 10**12


class LineCounter:
    """Counts line events in prefetch.py frames while active (a test-only tracer, restored on exit)."""

    def __init__(self):
        self.lines = 0

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename == prefetch.__file__ else None

    def __enter__(self):
        self.previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.previous)


def steady_state(window: int, fetches: int = 20):
    """Per-fetch line counts of reached() and plan() at ``window`` one-numel parameters ahead of use."""
    modules = [zmodule(10_000 + i, zparam(i, 1)) for i in range(MODULES)]
    prefetcher = PassPrefetcher("forward", PassTrace(PassKind.FORWARD, modules), bucket_numel=window)
    reached_cost, plan_cost = [], []
    for step in range(MODULES // 2):
        measure = step >= MODULES // 2 - fetches
        counter = LineCounter()
        with (counter if measure else _Null()):
            prefetcher.reached(step)
        before = counter.lines
        with (counter if measure else _Null()):
            chosen = prefetcher.plan(0, UNLIMITED)
        for param in chosen:
            param.ds_status = ZeroParamStatus.INFLIGHT
        if measure:
            reached_cost.append(before)
            plan_cost.append(counter.lines - before)
            assert len(chosen) == 1  # one use left the window, one enters it
            assert len(prefetcher.outstanding) == window and prefetcher.outstanding_numel == window
            assert len(prefetcher.outstanding_by_step) == window
    return reached_cost, plan_cost


class _Null:

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.skipif(sys.gettrace() is not None, reason="another tracer (a debugger, coverage) is active")
def test_reached_and_plan_cost_the_same_at_a_window_of_2_and_of_500():
    small_reached, small_plan = steady_state(2)
    large_reached, large_plan = steady_state(500)
    assert len(set(small_reached)) == 1 and len(set(small_plan)) == 1  # every fetch costs the same
    assert large_reached == small_reached
    assert large_plan == small_plan
    assert small_reached[0] < 20 and small_plan[0] < 40  # a handful of lines, not a walk of the window


def test_forget_and_adopt_keep_the_index_and_the_counter_exact():
    modules = [zmodule(100 + i, zparam(i, i + 1)) for i in range(6)]
    prefetcher = PassPrefetcher("forward", PassTrace(PassKind.FORWARD, modules), bucket_numel=UNLIMITED)
    params = prefetcher.plan(0, UNLIMITED)
    assert prefetcher.outstanding_numel == 21 and sorted(prefetcher.outstanding_by_step) == [0, 1, 2, 3, 4, 5]
    prefetcher.forget(params[2])
    assert prefetcher.outstanding_numel == 18 and 2 not in prefetcher.outstanding_by_step
    prefetcher.reached(3)
    assert prefetcher.outstanding == {params[4]: 4, params[5]: 5} and prefetcher.outstanding_numel == 11
    prefetcher.claims[params[0]] = 5  # claimed for a later step, kept at its release
    prefetcher.adopt(params[0])
    assert prefetcher.outstanding_by_step[5] == {params[5]: None, params[0]: None}
    assert prefetcher.outstanding_numel == 12
    prefetcher.reached(5)
    assert prefetcher.outstanding == {} and prefetcher.outstanding_by_step == {}
    assert prefetcher.outstanding_numel == 0
