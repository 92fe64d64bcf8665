"""PassTrace, TraceCache and PassProgress over small real modules with hand-set ds_ids and numels."""

import pytest

from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.trace import (PassProgress, PassTrace, ReplayState, StepOutcome, TraceCache)
from zero_fakes import zmodule, zparam


@pytest.fixture
def model():
    """m0: p0(4), p1(2) registered in reverse; m1: p2(8); m2: p3(1) + external p0; leaf: child params p4(3), p5(5)."""
    p = [zparam(i, n) for i, n in enumerate([4, 2, 8, 1, 3, 5])]
    m0 = zmodule(10, p[1], p[0])
    m1 = zmodule(11, p[2])
    m2 = zmodule(12, p[3], external=[p[0]])
    leaf = zmodule(13)
    leaf.child = zmodule(14, p[5], p[4])
    leaf._z3_leaf = True
    return p, (m0, m1, m2, leaf)


# ---------------------------------------------------------------------------- PassTrace


def test_trace_records_params_per_step_sorted_by_ds_id(model):
    p, (m0, m1, m2, leaf) = model
    trace = PassTrace(PassKind.FORWARD, [m0, m1, m2, leaf])

    assert trace.kind is PassKind.FORWARD
    assert len(trace) == 4
    assert trace.module_ids == (10, 11, 12, 13)
    # Sorted by ds_id, not registration order; externals included; a z3 leaf covers its subtree.
    assert trace.step_params == ((p[0], p[1]), (p[2], ), (p[0], p[3]), (p[4], p[5]))
    assert trace.param_uses == ((p[0], 0), (p[1], 0), (p[2], 1), (p[0], 2), (p[3], 2), (p[4], 3), (p[5], 3))
    assert trace.cumulative_numel == [0, 6, 14, 19, 27]
    assert trace.total_numel == 27
    assert trace.describe() == "forward trace of 4 modules, 27 numel"
    assert trace.next_backward is None


def test_non_leaf_parent_fetches_only_its_own_params(model):
    p, (_, _, _, leaf) = model
    leaf._z3_leaf = False
    trace = PassTrace(PassKind.BACKWARD, [leaf, leaf.child])
    assert trace.step_params == ((), (p[4], p[5]))
    assert trace.cumulative_numel == [0, 0, 8]


def test_next_use(model):
    p, (m0, m1, m2, leaf) = model
    trace = PassTrace(PassKind.FORWARD, [m0, m1, m2, leaf, m0])

    assert trace.use_steps[p[0]] == [0, 2, 4]
    assert trace.next_use(p[0], -1) == 0
    assert trace.next_use(p[0], 0) == 2
    assert trace.next_use(p[0], 1) == 2
    assert trace.next_use(p[0], 2) == 4
    assert trace.next_use(p[0], 4) is None
    assert trace.next_use(p[2], 1) is None
    assert trace.next_use(zparam(99, 1), -1) is None  # not in the trace


def test_numel_between(model):
    _, (m0, m1, m2, leaf) = model
    trace = PassTrace(PassKind.FORWARD, [m0, m1, m2, leaf])  # step numels 6, 8, 5, 8

    assert trace.numel_between(0, 4) == 27
    assert trace.numel_between(1, 2) == 8
    assert trace.numel_between(1, 3) == 13
    assert trace.numel_between(3, 3) == 0
    assert trace.numel_between(3, 1) == 0  # stop before start: nothing between
    assert trace.numel_between(-5, 1) == 6  # clamped to the trace
    assert trace.numel_between(2, 99) == 13
    assert trace.numel_between(7, 99) == 0


def test_starts_with(model):
    _, (m0, m1, m2, _) = model
    trace = PassTrace(PassKind.FORWARD, [m0, m1, m2])
    assert trace.starts_with([])
    assert trace.starts_with([10, 11])
    assert trace.starts_with([10, 11, 12])
    assert not trace.starts_with([10, 12])
    assert not trace.starts_with([10, 11, 12, 13])


# ---------------------------------------------------------------------------- TraceCache


def modules_by_id(*ids):
    return {i: zmodule(i, zparam(i, 1)) for i in ids}


def trace_of(kind, modules, ids):
    return PassTrace(kind, [modules[i] for i in ids])


def test_cache_capacity_must_be_positive():
    with pytest.raises(ValueError, match="trace cache capacity must be >= 1, got 0"):
        TraceCache(0)


def test_cache_is_lru_per_kind_and_bounded():
    mods = modules_by_id(1, 2, 3, 4)
    cache = TraceCache(capacity_per_kind=2)
    a = trace_of(PassKind.FORWARD, mods, [1])
    b = trace_of(PassKind.FORWARD, mods, [2])
    c = trace_of(PassKind.FORWARD, mods, [3])
    back = trace_of(PassKind.BACKWARD, mods, [4])

    assert cache.most_recent(PassKind.FORWARD) is None
    cache.add(a)
    cache.add(b)
    cache.add(back)
    assert cache.traces[PassKind.FORWARD] == [b, a]
    assert cache.most_recent(PassKind.FORWARD) is b
    assert cache.most_recent(PassKind.BACKWARD) is back
    assert cache.most_recent(PassKind.EVAL_FORWARD) is None
    assert len(cache) == 3

    cache.touch(a)  # a becomes the most recent, b the least
    assert cache.traces[PassKind.FORWARD] == [a, b]
    cache.add(c)  # over capacity: the least recently used (b) goes
    assert cache.traces[PassKind.FORWARD] == [c, a]
    cache.touch(c)  # touching the front keeps one copy
    assert cache.traces[PassKind.FORWARD] == [c, a]
    assert cache.traces[PassKind.BACKWARD] == [back]  # other kinds keep their own capacity
    assert len(cache) == 3

    cache.clear()
    assert len(cache) == 0
    assert cache.most_recent(PassKind.FORWARD) is None


def test_cache_find_prefix_and_exact():
    mods = modules_by_id(1, 2, 3, 4)
    cache = TraceCache()
    long = trace_of(PassKind.FORWARD, mods, [1, 2, 3])
    short = trace_of(PassKind.FORWARD, mods, [1, 2])
    other = trace_of(PassKind.FORWARD, mods, [1, 4])
    cache.add(long)
    cache.add(short)
    cache.add(other)  # recency: other, short, long

    assert cache.find(PassKind.FORWARD, [1]) is other  # most recent with that prefix
    assert cache.find(PassKind.FORWARD, [1, 2]) is short
    assert cache.find(PassKind.FORWARD, [1, 2, 3]) is long
    assert cache.find(PassKind.FORWARD, [1, 3]) is None
    assert cache.find(PassKind.FORWARD, []) is other

    assert cache.find(PassKind.FORWARD, [1, 2], exact=True) is short
    assert cache.find(PassKind.FORWARD, [1, 2, 3], exact=True) is long
    assert cache.find(PassKind.FORWARD, [1], exact=True) is None
    assert cache.find(PassKind.BACKWARD, [1, 2]) is None  # kinds do not mix
    assert cache.find(PassKind.EVAL_FORWARD, [1, 2], exact=True) is None

    cache.touch(long)  # find itself does not change recency, touch does
    assert cache.find(PassKind.FORWARD, [1, 2]) is long


# ---------------------------------------------------------------------------- PassProgress


def test_progress_without_a_guess_records():
    mods = modules_by_id(1, 2)
    progress = PassProgress(PassKind.FORWARD, TraceCache(), None)
    assert progress.state is ReplayState.RECORDING
    assert not progress.replaying()
    assert progress.step == -1
    assert progress.observe(mods[1]) is StepOutcome.RECORDING
    assert progress.observe(mods[2]) is StepOutcome.RECORDING
    assert progress.step == 1
    assert progress.observed == [mods[1], mods[2]]
    assert progress.observed_ids == [1, 2]
    assert progress.completed_trace() is None


def test_progress_matched_completes_the_trace():
    mods = modules_by_id(1, 2, 3)
    cache = TraceCache()
    trace = trace_of(PassKind.FORWARD, mods, [1, 2, 3])
    cache.add(trace)
    progress = PassProgress(PassKind.FORWARD, cache, trace)

    assert progress.replaying()
    outcomes = []
    for i in (1, 2):
        outcomes.append(progress.observe(mods[i]))
        assert progress.completed_trace() is None  # not at the end yet
    outcomes.append(progress.observe(mods[3]))
    assert outcomes == [StepOutcome.MATCHED] * 3
    assert progress.trace is trace
    assert progress.step == 2
    assert progress.completed_trace() is trace


def test_progress_switches_to_a_cached_trace_sharing_the_prefix():
    mods = modules_by_id(1, 2, 3, 4, 5)
    cache = TraceCache()
    other = trace_of(PassKind.FORWARD, mods, [1, 2, 4, 5])
    guess = trace_of(PassKind.FORWARD, mods, [1, 2, 3])
    cache.add(other)
    cache.add(trace_of(PassKind.BACKWARD, mods, [1, 2, 4]))  # wrong kind: never a candidate
    cache.add(guess)
    progress = PassProgress(PassKind.FORWARD, cache, guess)

    assert progress.observe(mods[1]) is StepOutcome.MATCHED
    assert progress.observe(mods[2]) is StepOutcome.MATCHED
    assert progress.observe(mods[4]) is StepOutcome.SWITCHED
    assert progress.trace is other
    assert progress.replaying()
    assert progress.completed_trace() is None
    assert progress.observe(mods[5]) is StepOutcome.MATCHED
    assert progress.completed_trace() is other


def test_progress_switches_when_the_pass_runs_past_its_trace():
    mods = modules_by_id(1, 2, 3)
    cache = TraceCache()
    longer = trace_of(PassKind.BACKWARD, mods, [1, 2, 3])
    guess = trace_of(PassKind.BACKWARD, mods, [1, 2])
    cache.add(longer)
    cache.add(guess)
    progress = PassProgress(PassKind.BACKWARD, cache, guess)

    assert [progress.observe(mods[i]) for i in (1, 2, 3)] == [StepOutcome.MATCHED, StepOutcome.MATCHED,
                                                              StepOutcome.SWITCHED]
    assert progress.completed_trace() is longer


def test_progress_diverges_when_nothing_cached_fits():
    mods = modules_by_id(1, 2, 3, 4)
    cache = TraceCache()
    guess = trace_of(PassKind.FORWARD, mods, [1, 2, 3])
    cache.add(guess)
    cache.add(trace_of(PassKind.BACKWARD, mods, [1, 4]))  # fits, but another kind
    progress = PassProgress(PassKind.FORWARD, cache, guess)

    assert progress.observe(mods[1]) is StepOutcome.MATCHED
    assert progress.observe(mods[4]) is StepOutcome.DIVERGED
    assert progress.state is ReplayState.RECORDING
    assert progress.trace is None
    assert progress.observe(mods[3]) is StepOutcome.RECORDING
    assert progress.observed_ids == [1, 4, 3]
    assert progress.completed_trace() is None


def test_progress_diverges_on_a_different_module_with_the_same_ds_id():
    mods = modules_by_id(1, 2)
    impostor = zmodule(2, zparam(2, 1))
    cache = TraceCache()
    guess = trace_of(PassKind.FORWARD, mods, [1, 2])
    cache.add(guess)
    progress = PassProgress(PassKind.FORWARD, cache, guess)

    assert progress.observe(mods[1]) is StepOutcome.MATCHED
    assert progress.observe(impostor) is StepOutcome.DIVERGED
    assert progress.completed_trace() is None


def test_progress_shorter_than_its_trace_is_not_completed():
    mods = modules_by_id(1, 2)
    guess = trace_of(PassKind.EVAL_FORWARD, mods, [1, 2])
    progress = PassProgress(PassKind.EVAL_FORWARD, TraceCache(), guess)
    assert progress.completed_trace() is None
    assert progress.observe(mods[1]) is StepOutcome.MATCHED
    assert progress.completed_trace() is None
    assert progress.replaying()
