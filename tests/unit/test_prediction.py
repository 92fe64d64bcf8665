"""First-pass guesses ([Note: first-pass prediction]) and the keep plan ([Note: budgeted keeping]), on fakes."""

from deepspeed_zero3.runtime.zero.keeping import plan_kept
from deepspeed_zero3.runtime.zero.prediction import PassPrediction, PredictedTrace
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.trace import PassProgress, PassTrace, StepOutcome, TraceCache
from zero_fakes import zmodule, zparam


def tree():
    """root (no params) > a (p0: 4), box (no params) > b (p1: 8), c (p2: 2)."""
    p = [zparam(i, n) for i, n in enumerate([4, 8, 2])]
    root, a, box, b, c = zmodule(0), zmodule(1, p[0]), zmodule(2), zmodule(3, p[1]), zmodule(4, p[2])
    return p, [root, a, box, b, c]


def test_registration_guess_keeps_modules_with_params_in_ds_id_order():
    _, modules = tree()
    prediction = PassPrediction()
    prediction.managed_modules = lambda: list(reversed(modules))
    guess = prediction.forward_guess(PassKind.FORWARD, TraceCache())
    assert guess.predicted and guess.source == "registration"
    assert guess.module_ids == (1, 3, 4)


def test_registration_guess_leaves_out_a_leaf_that_cannot_run_a_forward():
    """A z3 leaf ModuleList fetches its subtree but never runs: its parameters are read through the getter."""
    p = [zparam(i, n) for i, n in enumerate([4, 8])]
    container = zmodule(1, p[0], container=True)
    container._z3_leaf = True
    prediction = PassPrediction()
    prediction.managed_modules = lambda: [zmodule(0), container, zmodule(2, p[1])]
    assert prediction.forward_guess(PassKind.FORWARD, TraceCache()).module_ids == (2, )


def test_eval_forward_borrows_the_training_forward_and_backward_reverses_it():
    _, (root, a, box, b, c) = tree()
    cache = TraceCache()
    forward = PassTrace(PassKind.FORWARD, [root, a, box, b, c])
    cache.add(forward)
    prediction = PassPrediction()
    borrowed = prediction.forward_guess(PassKind.EVAL_FORWARD, cache)
    assert borrowed.source == "borrowed" and borrowed.kind is PassKind.EVAL_FORWARD
    assert borrowed.module_ids == (1, 3, 4)
    assert prediction.forward_guess(PassKind.FORWARD, cache) is forward  # its own trace is no guess
    backward = prediction.backward_guess(forward, cache)
    assert backward.source == "reversed" and backward.module_ids == (4, 3, 1)
    assert prediction.expected_backward(forward) is backward  # made once per forward trace


def test_a_guess_is_followed_loosely_and_never_completes_as_a_cached_trace():
    _, (root, a, box, b, c) = tree()
    guess = PredictedTrace(PassKind.FORWARD, [a, b, c], "registration")
    progress = PassProgress(PassKind.FORWARD, TraceCache(), guess)
    steps = []
    for module in (root, a, box, b, c):
        assert progress.observe(module) is StepOutcome.MATCHED
        steps.append(progress.trace_step)
    assert steps == [-1, 0, 0, 1, 2]  # modules without parameters stay at the guess's step
    assert progress.step == 4 and progress.completed_trace() is None


def test_a_guess_misses_on_a_reordered_or_repeated_module():
    _, (root, a, box, b, c) = tree()
    guess = PredictedTrace(PassKind.FORWARD, [a, b, c], "registration")
    progress = PassProgress(PassKind.FORWARD, TraceCache(), guess)
    assert progress.observe(root) is StepOutcome.MATCHED
    assert progress.observe(b) is StepOutcome.DIVERGED
    assert not progress.replaying() and progress.trace_step == 1
    progress = PassProgress(PassKind.FORWARD, TraceCache(), PredictedTrace(PassKind.FORWARD, [a, b], "registration"))
    assert [progress.observe(m) for m in (a, b, a)][-1] is StepOutcome.DIVERGED


def test_keep_plan_is_the_backward_prefix_within_cap_less_bucket_and_reuse():
    p, (root, a, box, b, c) = tree()
    forward = PassTrace(PassKind.FORWARD, [root, a, box, b, c])
    backward = PassTrace(PassKind.BACKWARD, [c, b, a])

    def settings(cap, reuse, bucket=1):
        """The backward keeping's limits (keeping.BackwardKeeping.keeps) for these settings."""
        values = PrefetchSettings(bucket, cap, reuse)
        return max(values.max_reuse_numel, values.bucket_numel), values.max_live_numel - values.bucket_numel

    # reuse 0 keeps what is back within one bucket: c (distance 0); b (4) only with a bucket over 4
    assert plan_kept(forward, backward, *settings(100, 0)) == {p[2]}
    assert plan_kept(forward, backward, *settings(100, 0, bucket=5)) == {p[2], p[1]}
    assert plan_kept(forward, backward, *settings(100, 4, bucket=5)) == {p[2], p[1]}  # the larger of the two
    assert plan_kept(forward, backward, *settings(100, 10**9)) == {p[0], p[1], p[2]}
    assert plan_kept(forward, backward, *settings(11, 10**9)) == {p[2], p[1]}  # 10 <= 11 - 1
    assert plan_kept(forward, backward, *settings(10, 10**9)) == {p[2]}  # c, then b does not fit: stop
    # reuse distance of b: forward after its last use (c: 2) + backward before its first use (c: 2) = 4
    assert plan_kept(forward, backward, *settings(100, 4)) == {p[2]}
    assert plan_kept(forward, backward, *settings(100, 5)) == {p[2], p[1]}


def test_a_module_that_gathers_nothing_is_left_out_and_may_run_anywhere():
    """A LayerNorm under the persistence threshold: registered after the layer's Linears (HF Llama registers
    input_layernorm after self_attn and mlp) but run first; it gathers nothing, so the guess still holds."""
    linear_a, linear_b = zparam(0, 16), zparam(1, 16)
    norm = zmodule(2, zparam(2, 4, persist=True))
    a, b = zmodule(1, linear_a), zmodule(3, linear_b)
    prediction = PassPrediction()
    prediction.managed_modules = lambda: [a, norm, b]
    guess = prediction.forward_guess(PassKind.FORWARD, TraceCache())
    assert guess.module_ids == (1, 3)
    progress = PassProgress(PassKind.FORWARD, TraceCache(), guess)
    assert [progress.observe(m) for m in (norm, a, norm, b)] == [StepOutcome.MATCHED] * 4
    assert progress.replaying()
