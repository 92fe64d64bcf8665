"""``KeepRule`` ([Note: a keep rule per pass]): why a released parameter stays gathered, from the facts of one pass.

Trace: m0 (a 4) | m1 (b 4) | m2 (c 4) | m3 (a again, through an external read). a's next use after step 0 is
step 3, 8 numel of fetches later (m1, m2).
"""

from deepspeed_zero3.runtime.zero.keep_rule import KeepRule
from deepspeed_zero3.runtime.zero.keeping import BackwardKeeping
from deepspeed_zero3.runtime.zero.nograd_keeping import NoGradKeeping
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.residency import Reason
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.trace import PassTrace

from zero_fakes import zmodule, zparam

a, b, c = zparam(0, 4), zparam(1, 4), zparam(2, 4)
MODULES = [zmodule(10, a), zmodule(11, b), zmodule(12, c), zmodule(13, external=[a])]


def settings(reuse, cap=10**9, bucket=4):
    return PrefetchSettings(bucket_numel=bucket, max_live_numel=cap, max_reuse_numel=reuse)


def rule(kind, trace, following=None):
    return KeepRule(kind, trace, following, BackwardKeeping(), NoGradKeeping())


def test_a_pass_that_records_keeps_nothing():
    assert rule(PassKind.FORWARD, None).reason(a, 0, 0, settings(reuse=10**9)) is None


def test_reuse_within_the_distance_and_the_cap():
    trace = PassTrace(PassKind.BACKWARD, MODULES)
    backward = rule(PassKind.BACKWARD, trace)
    assert backward.reason(a, 0, 0, settings(reuse=9)) is Reason.REUSE  # 8 numel away
    assert backward.reason(a, 0, 0, settings(reuse=8)) is None  # the distance must be under the limit
    assert backward.reason(a, 0, 11, settings(reuse=9, cap=10)) is None  # live numel over the cap
    assert backward.reason(a, 3, 0, settings(reuse=9)) is None  # its last use
    assert backward.reason(b, 1, 0, settings(reuse=0)) is None


def test_an_eval_forward_keeps_its_first_parameters_for_the_next_one():
    trace = PassTrace(PassKind.EVAL_FORWARD, MODULES)
    evaluation = rule(PassKind.EVAL_FORWARD, trace)
    assert evaluation.reason(a, 3, 0, settings(reuse=10**9, cap=8)) is Reason.FOR_NEXT_EVAL
    assert evaluation.reason(c, 2, 0, settings(reuse=10**9, cap=8)) is None  # a and b fill the cap


def test_a_forward_keeps_for_the_backward_it_was_built_for_only():
    forward = PassTrace(PassKind.FORWARD, MODULES)
    backward = PassTrace(PassKind.BACKWARD, list(reversed(MODULES)))
    kept = rule(PassKind.FORWARD, forward, following=backward)
    # The backward starts with m3 (a): a's distance is 0, under one bucket even at reuse 0; c's (m3's 4 + m3's
    # 4 again in the backward) is 8, and the walk stops there.
    assert kept.reason(a, 3, 0, settings(reuse=0, bucket=4)) is Reason.FOR_BACKWARD
    assert kept.reason(c, 2, 0, settings(reuse=0, bucket=4)) is None
    assert rule(PassKind.FORWARD, forward).reason(a, 3, 0, settings(reuse=0, bucket=4)) is None
