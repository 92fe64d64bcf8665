"""Trace selection by what runs: alternation, training-only branches and generation loops stop re-recording.

Model B (199,876 parameters; testing/models.py), bucket 20,000, reuse 0. Upstream 0.19.8 demand-fetches
34,176 numel in every backward that follows an eval forward (17%); here, after the first cycle,
no pass demand-fetches and no pass records a trace.
"""

import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.engines import (batch, gathered_copies, inference_engine, mse_loss, training_engine,
                                             zero3_config)
from deepspeed_zero3.testing.models import MODEL_B_NUMEL, TinyGPT, model_b

MODEL_B = MODEL_B_NUMEL
AUX = 64 * 64 + 64
KEPT = 260 + 16_448  # head + the last down, which a forward keeps for its backward ([Note: budgeted keeping])


def passes(engine):
    return deepspeed_zero3.get_zero3_stats(engine)["passes"]


def train_then_eval(engine, step, eval_grad=False):
    x = batch(step, torch.distributed.get_rank())
    engine.backward(mse_loss(engine(x)))
    engine.step()
    engine.eval()
    with torch.set_grad_enabled(eval_grad):
        engine(x)
    engine.train()


def assert_quiet(records, label):
    for p in records:
        assert p["demand_numel"] == 0, (label, p)
        assert p["trace_records"] == 0 and p["trace_mismatches"] == 0, (label, p)


@pytest.mark.world_size(2, 4)
def test_train_eval_alternation_stops_recording():
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    train_then_eval(engine, 0)
    first = passes(engine)
    assert [p["kind"] for p in first] == ["forward", "backward", "eval_forward"]
    assert [p["trace_records"] for p in first] == [1, 1, 1]
    deepspeed_zero3.reset_zero3_stats(engine)
    for step in range(1, 5):
        train_then_eval(engine, step)
    later = passes(engine)
    assert len(later) == 12
    assert_quiet(later, "alternation")
    for p in later:  # eval gathers 1.0x, upstream 1.17x; the forward keeps head + the last down for the backward
        assert p["allgather_numel"] == (MODEL_B - KEPT if p["kind"] == "backward" else MODEL_B), p
    engine.destroy()


def test_training_only_branch_with_no_grad_eval():
    torch.manual_seed(0)
    engine = training_engine(model_b(training_branch=True), zero3_config(bucket=20_000, reuse=0))
    train_then_eval(engine, 0)
    deepspeed_zero3.reset_zero3_stats(engine)
    for step in range(1, 5):
        train_then_eval(engine, step)
    later = passes(engine)
    assert_quiet(later, "branch")
    by_kind = {p["kind"]: p["allgather_numel"] for p in later}
    # the forward keeps head, aux and the last down (each back within one bucket) for the backward
    assert by_kind == {"forward": MODEL_B + AUX, "backward": MODEL_B - KEPT, "eval_forward": MODEL_B}
    engine.destroy()


def test_training_only_branch_with_grad_enabled_eval_switches_traces():
    """Eval without no_grad is a forward with grad: two forward traces share a prefix and the cache switches.

    Which one runs cannot be known before the branch (that would need nn.Module.training), so the module at
    the branch point is fetched on demand once per pass; nothing is re-recorded.
    """
    torch.manual_seed(0)
    engine = training_engine(model_b(training_branch=True), zero3_config(bucket=20_000, reuse=0))
    train_then_eval(engine, 0, eval_grad=True)
    train_then_eval(engine, 1, eval_grad=True)
    deepspeed_zero3.reset_zero3_stats(engine)
    for step in range(2, 5):
        train_then_eval(engine, step, eval_grad=True)
    later = passes(engine)
    for p in later:
        assert p["trace_records"] == 0 and p["trace_mismatches"] == 0, p
    forwards = [p for p in later if p["kind"] == "forward"]
    assert all(p["trace_switches"] == 1 for p in forwards)
    assert sum(p["demand_numel"] for p in later if p["kind"] == "backward") == 0
    engine.destroy()


def test_generation_loop_then_train_stops_recording():
    """16 no-grad forwards of growing length, then a training step, repeated (RLHF generate-then-train)."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=2, layers=2, max_seq=32)
    engine = training_engine(model, zero3_config(bucket=5_000, reuse=0))
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(rank)

    def cycle():
        tokens = torch.randint(0, 64, (2, 4), generator=generator)
        engine.eval()
        with torch.no_grad():
            for _ in range(16):
                logits = engine(tokens)
                tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
        engine.train()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()

    cycle()
    assert sum(p["trace_records"] for p in passes(engine)) == 3  # eval forward, forward, backward
    deepspeed_zero3.reset_zero3_stats(engine)
    cycle()
    cycle()
    later = passes(engine)
    assert len(later) == 2 * 18
    assert_quiet(later, "generation")
    engine.destroy()


class Router(torch.nn.Module):
    """Five 16x16 layers run in the order the forward's ``route`` names: data-dependent control flow."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({name: torch.nn.Linear(16, 16) for name in "ABCDX"})

    def forward(self, x, route):
        for name in route:
            x = self.layers[name](x)
        return x


LAYER = 16 * 16 + 16


def test_switch_then_divergence_regathers_a_sibling_released_as_stale():
    """Cached traces A-B-X-D and A-B-C-D (most recent); the third pass runs A-B-X-C.

    C is prefetched (weight and bias in one call). At X the pass switches to A-B-X-D and releases C as stale:
    waiting for C's weight completes its bias too. The pass then leaves that trace as well and runs C, which
    must be gathered again. Before the fix the bias stayed registered as in flight and the gather raised
    `RuntimeError: parameter ds_id=5 shape=(16,) is already in flight`.
    """
    torch.manual_seed(0)
    model = Router()
    engine = inference_engine(model, zero3_config(bucket=2 * LAYER, reuse=0))
    x = batch(0, torch.distributed.get_rank())
    with torch.no_grad():
        engine(x, "ABXD")
        engine(x, "ABCD")
        deepspeed_zero3.reset_zero3_stats(engine)
        out = engine(x, "ABXC")
    (third,) = passes(engine)
    assert third["trace_switches"] == 1 and third["trace_mismatches"] == 1 and third["trace_records"] == 1
    # The root (no parameters of its own) is step 0: A+B prefetched in one call, then C, then D; X on
    # demand; C on demand again after the divergence.
    assert third["allgather_calls"] == 5, third
    assert third["allgather_numel"] == 6 * LAYER, third
    assert third["prefetch_numel"] == 4 * LAYER and third["demand_numel"] == 2 * LAYER, third
    assert third["peak_live_numel"] == 3 * LAYER, third
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0

    layers = {name: gathered_copies(model.layers[name].parameters()) for name in "ABXC"}
    expected = x
    for name in "ABXC":
        weight, bias = layers[name]
        expected = torch.nn.functional.linear(expected, weight, bias)
    assert torch.equal(out, expected)
    engine.destroy()
