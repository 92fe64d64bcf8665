"""PassPrefetcher planning over a hand-built trace: window, live cap, whole modules, claims, reached, rebase."""

import pytest
from torch import nn

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.prefetch import PassPrefetcher
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.trace import PassTrace
from zero_fakes import zmodule, zparam

NOT_AVAILABLE = ZeroParamStatus.NOT_AVAILABLE
AVAILABLE = ZeroParamStatus.AVAILABLE
INFLIGHT = ZeroParamStatus.INFLIGHT
UNLIMITED = 10**12


class Model:
    """m0: a(4) b(4) | m1: c(4) d(1) | m2: e(4) | m3: f(6) | m4: g(2).  Trace A runs m0 m1 m2 m3."""

    def __init__(self):
        self.a, self.b, self.c, self.d, self.e, self.f, self.g = (zparam(i, n)
                                                                  for i, n in enumerate([4, 4, 4, 1, 4, 6, 2]))
        self.m0 = zmodule(10, self.a, self.b)
        self.m1 = zmodule(11, self.c, self.d)
        self.m2 = zmodule(12, self.e)
        self.m3 = zmodule(13, self.f)
        self.m4 = zmodule(14, self.g)

    def trace(self, *modules, kind=PassKind.FORWARD):
        return PassTrace(kind, modules)

    def names(self, params):
        by_id = {id(p): n for n, p in vars(self).items() if isinstance(p, nn.Parameter)}
        return [by_id[id(p)] for p in params]


@pytest.fixture
def model():
    return Model()


def gathered(params, status=INFLIGHT):
    """What the coordinator does with a plan: the params are in flight (then available)."""
    for param in params:
        param.ds_status = status


def test_window_is_bounded_by_the_bucket(model):
    trace = model.trace(model.m0, model.m1, model.m2, model.m3)
    prefetcher = PassPrefetcher("forward", trace, bucket_numel=8)

    first = prefetcher.plan(live_numel=0, max_live_numel=UNLIMITED)
    assert model.names(first) == ["a", "b"]  # 8 numel: the window is full at the module boundary
    assert prefetcher.outstanding_numel == 8
    assert prefetcher.outstanding == {model.a: 0, model.b: 0}
    gathered(first)
    assert prefetcher.plan(live_numel=8, max_live_numel=UNLIMITED) == []

    prefetcher.reached(0)  # m0 runs: a and b are in use, not ahead any more
    assert prefetcher.outstanding_numel == 0
    second = prefetcher.plan(live_numel=8, max_live_numel=UNLIMITED)
    assert model.names(second) == ["c", "d", "e"]  # 4 + 1 < 8, so e starts (and ends) m2: 9 numel
    assert prefetcher.outstanding == {model.c: 1, model.d: 1, model.e: 2}
    assert prefetcher.outstanding_numel == 9


def test_the_window_counts_what_is_still_outstanding(model):
    trace = model.trace(model.m0, model.m1, model.m2, model.m3)
    prefetcher = PassPrefetcher("forward", trace, bucket_numel=10)

    assert model.names(prefetcher.plan(0, UNLIMITED)) == ["a", "b", "c", "d"]  # 13: m1 finished
    assert prefetcher.outstanding_numel == 13
    gathered([model.a, model.b, model.c, model.d])
    prefetcher.reached(0)  # c and d (5 numel) are still ahead of use
    assert prefetcher.outstanding_numel == 5
    # Budget 10 - 5 = 5: e (4) fits under it, so the walk starts m3 and takes f (6) whole.
    assert model.names(prefetcher.plan(8, UNLIMITED)) == ["e", "f"]
    assert prefetcher.outstanding_numel == 15
    assert prefetcher.plan(8, UNLIMITED) == []  # trace exhausted


def test_a_started_module_is_taken_whole_past_the_budget(model):
    trace = model.trace(model.m0, model.m1, model.m2)
    prefetcher = PassPrefetcher("forward", trace, bucket_numel=1)

    assert model.names(prefetcher.plan(0, UNLIMITED)) == ["a", "b"]  # a alone fills 1; b completes m0
    assert prefetcher.outstanding_numel == 8
    gathered([model.a, model.b])
    prefetcher.reached(0)
    assert model.names(prefetcher.plan(8, UNLIMITED)) == ["c", "d"]  # the bias-sized d comes along
    prefetcher.reached(1)
    assert model.names(prefetcher.plan(13, UNLIMITED)) == ["e"]


def test_live_cap_limits_the_plan(model):
    trace = model.trace(model.m0, model.m1, model.m2, model.m3)

    capped = PassPrefetcher("forward", trace, bucket_numel=UNLIMITED)
    # Budget min(bucket, 12 - 3) = 9: a, b (8) then c starts m1 and d completes it.
    assert model.names(capped.plan(live_numel=3, max_live_numel=12)) == ["a", "b", "c", "d"]

    full = PassPrefetcher("forward", trace, bucket_numel=UNLIMITED)
    assert full.plan(live_numel=12, max_live_numel=12) == []
    assert full.plan(live_numel=20, max_live_numel=12) == []
    assert full.outstanding == {} and full.claims == {}
    # Nothing was walked: once there is room, planning starts at the beginning of the trace.
    assert model.names(full.plan(live_numel=0, max_live_numel=4)) == ["a", "b"]


def test_zero_bucket_plans_nothing(model):
    prefetcher = PassPrefetcher("forward", model.trace(model.m0, model.m1), bucket_numel=0)
    assert prefetcher.plan(0, UNLIMITED) == []


def test_available_params_are_claimed_not_gathered(model):
    model.c.ds_status = AVAILABLE  # e.g. kept by the reuse distance
    model.e.ds_status = INFLIGHT  # gathered by someone else already
    model.d.ds_status = AVAILABLE
    model.d.ds_persist = True  # persistent: always there, never claimed
    trace = model.trace(model.m0, model.m1, model.m2, model.m3)
    prefetcher = PassPrefetcher("forward", trace, bucket_numel=UNLIMITED)

    assert model.names(prefetcher.plan(0, UNLIMITED)) == ["a", "b", "f"]
    assert prefetcher.outstanding == {model.a: 0, model.b: 0, model.f: 3}
    assert prefetcher.claims == {model.a: 0, model.b: 0, model.c: 1, model.e: 2, model.f: 3}
    assert prefetcher.holds(model.c, -1) and prefetcher.holds(model.c, 0)
    assert not prefetcher.holds(model.c, 1)  # its claimed step is now: no longer held past it
    assert prefetcher.holds(model.e, 1)
    assert not prefetcher.holds(model.d, -1)
    assert not prefetcher.holds(model.g, -1)  # never walked


def test_claimed_params_do_not_count_against_the_window(model):
    model.a.ds_status = AVAILABLE
    model.b.ds_status = AVAILABLE
    trace = model.trace(model.m0, model.m1, model.m2)
    prefetcher = PassPrefetcher("forward", trace, bucket_numel=5)

    assert model.names(prefetcher.plan(8, UNLIMITED)) == ["c", "d"]
    assert prefetcher.outstanding_numel == 5


def test_a_param_used_twice_is_gathered_once_and_claimed_for_its_later_use(model):
    shared_user = zmodule(15, external=[model.a])  # uses a again, as an external parameter
    trace = model.trace(model.m0, model.m1, shared_user)
    prefetcher = PassPrefetcher("forward", trace, bucket_numel=UNLIMITED)

    assert model.names(prefetcher.plan(0, UNLIMITED)) == ["a", "b", "c", "d"]
    assert prefetcher.outstanding[model.a] == 0
    assert prefetcher.claims[model.a] == 2
    gathered([model.a, model.b, model.c, model.d], AVAILABLE)
    prefetcher.reached(0)
    assert model.a not in prefetcher.outstanding
    # The release after m0 finds the claim and keeps a: it counts in the window until step 2.
    assert prefetcher.holds(model.a, 0)
    prefetcher.adopt(model.a)
    assert prefetcher.outstanding == {model.c: 1, model.d: 1, model.a: 2}
    prefetcher.reached(1)
    assert prefetcher.outstanding == {model.a: 2}
    assert not prefetcher.holds(model.a, 2)
    prefetcher.reached(2)
    assert prefetcher.outstanding == {}


def test_reached_skips_the_walk_past_executed_steps(model):
    trace = model.trace(model.m0, model.m1, model.m2, model.m3)
    prefetcher = PassPrefetcher("forward", trace, bucket_numel=UNLIMITED)

    prefetcher.reached(1)  # steps 0 and 1 ran before any planning: they are fetched on demand, not here
    assert model.names(prefetcher.plan(0, UNLIMITED)) == ["e", "f"]
    assert prefetcher.outstanding == {model.e: 2, model.f: 3}
    prefetcher.reached(2)
    assert prefetcher.outstanding == {model.f: 3}
    assert prefetcher.outstanding_numel == 6
    prefetcher.reached(3)
    assert prefetcher.outstanding_numel == 0


def test_forget_drops_outstanding_and_claim(model):
    prefetcher = PassPrefetcher("forward", model.trace(model.m0, model.m1), bucket_numel=UNLIMITED)
    prefetcher.plan(0, UNLIMITED)
    prefetcher.forget(model.c)
    prefetcher.forget(model.g)  # unknown: nothing to do
    assert prefetcher.outstanding == {model.a: 0, model.b: 0, model.d: 1}
    assert not prefetcher.holds(model.c, -1)


def test_rebase_retargets_what_the_new_trace_uses_and_returns_the_rest(model):
    old = model.trace(model.m0, model.m1, model.m2, model.m3)
    new = model.trace(model.m0, model.m1, model.m4, model.m3)
    prefetcher = PassPrefetcher("forward", old, bucket_numel=UNLIMITED)
    assert model.names(prefetcher.plan(0, UNLIMITED)) == ["a", "b", "c", "d", "e", "f"]
    gathered([model.a, model.b, model.c, model.d, model.e, model.f])
    prefetcher.reached(0)
    prefetcher.reached(1)
    assert prefetcher.outstanding == {model.e: 2, model.f: 3}

    # Step 2 ran m4, not m2: the pass switched to the other trace.
    stale = prefetcher.rebase(new, 2)
    assert model.names(stale) == ["e"]  # m2's parameter: the new trace never uses it again
    assert prefetcher.trace is new
    assert prefetcher.outstanding == {model.f: 3}
    assert prefetcher.claims == {model.f: 3}  # old claims are dropped; f is claimed on the new trace
    assert prefetcher.holds(model.f, 2)
    # The walk resumes after step 2 of the new trace (g, used now, is the demand fetch's job).
    assert prefetcher.plan(14, UNLIMITED) == []
    assert model.g not in prefetcher.claims


def test_rebase_keeps_a_param_the_new_trace_uses_at_the_current_step(model):
    old = model.trace(model.m0, model.m1, model.m2, model.m3)
    new = model.trace(model.m0, model.m2, model.m3, model.m4)
    prefetcher = PassPrefetcher("forward", old, bucket_numel=UNLIMITED)
    prefetcher.plan(0, UNLIMITED)
    gathered([model.a, model.b, model.c, model.d, model.e, model.f])
    prefetcher.reached(0)

    stale = prefetcher.rebase(new, 1)  # step 1 ran m2 instead of m1
    assert model.names(stale) == ["c", "d"]
    assert prefetcher.outstanding == {model.e: 1, model.f: 2}
    prefetcher.reached(1)  # e is in use now
    assert prefetcher.outstanding == {model.f: 2}
    assert model.names(prefetcher.plan(14, UNLIMITED)) == ["g"]
    assert prefetcher.outstanding == {model.f: 2, model.g: 3}
