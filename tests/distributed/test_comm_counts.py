"""Exact all-gather counts, demand fetches and peak live numel per pass (FSDP2-style communication counts).

Model A (6,312,196 parameters; testing/models.py): inp Linear(16,256) = 4,352; 12 blocks of
up Linear(256,1024) = 263,168 and down Linear(1024,256) = 262,400; head Linear(256,4) = 1,028.
Two ranks, persistence threshold 0, so every parameter is gathered. Steady state = after the
first training step and the first eval forward recorded their traces.
"""

import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.instrument import GatherMeter
from deepspeed_zero3.testing.models import MODEL_A_NUMEL, count_params, model_a

MODEL_A = MODEL_A_NUMEL
UP, DOWN, INP, HEAD = 263_168, 262_400, 4_352, 1_028
PARAM_MODULES = 26  # inp, 24 block Linears, head


def last_passes(engine):
    stats = deepspeed_zero3.get_zero3_stats(engine)
    passes = stats["passes"]
    return {p["kind"]: p for p in passes[-3:]}


def run_cycles(engine, cycles, meter=None):
    """Each cycle: one training step, then one eval forward (no grad)."""
    for step in range(cycles):
        x = batch(step, torch.distributed.get_rank())
        if meter is not None:
            meter.reset()
        loss = mse_loss(engine(x))
        engine.backward(loss)
        engine.step()
        engine.eval()
        with torch.no_grad():
            engine(x)
        engine.train()


@pytest.fixture
def model():
    torch.manual_seed(0)
    return model_a()


# Reuse 0 still keeps what the backward's first window would gather again ([Note: budgeted keeping]): head
# (distance 0) and the last down (distance: head in the forward after it + head in the backward before it).
KEPT = HEAD + DOWN
# kind -> (gathered numel, all-gather calls, peak live numel). Forward and eval: the first gather covers two
# modules (the first one and the next up to the bucket line), then one per module; peak = the module in use
# (down) + the window, which holds the whole next module that crossed the bucket line (up). Backward: 24
# modules left to gather, one call each; peak = what was kept + the first window's up.
STEADY = {
    "forward": (MODEL_A, PARAM_MODULES - 1, DOWN + UP),
    "backward": (MODEL_A - KEPT, PARAM_MODULES - 2, KEPT + UP),
    "eval_forward": (MODEL_A, PARAM_MODULES - 1, DOWN + UP),
}


def test_model_a_steady_state_bucket_100k(model):
    engine = training_engine(model, zero3_config(bucket=100_000, reuse=0))
    assert count_params(engine.module) == MODEL_A
    run_cycles(engine, 3)
    passes = last_passes(engine)
    for kind, (numel, calls, peak) in STEADY.items():
        p = passes[kind]
        # Each parameter gathered at most once per pass, all ahead of use.
        assert p["allgather_numel"] == p["prefetch_numel"] == numel, kind
        assert p["demand_numel"] == 0, kind
        assert p["allgather_calls"] == calls, kind
        assert p["peak_live_numel"] == peak, kind
        assert p["trace_records"] == 0 and p["trace_mismatches"] == 0, kind
    # Nothing stays gathered between steps.
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()


def test_outside_instrument_agrees_with_stats(model):
    """The instrument used for upstream (wrapped deepspeed.comm + ds_status) reads the same numbers."""
    engine = training_engine(model, zero3_config(bucket=100_000, reuse=0))
    run_cycles(engine, 2)
    with GatherMeter(engine.module) as meter:
        x = batch(9, torch.distributed.get_rank())
        with meter.phase("forward"):
            loss = mse_loss(engine(x))
        with meter.phase("backward"):
            engine.backward(loss)
        with meter.phase("step"):
            engine.step()
    counts = meter.snapshot()
    passes = last_passes(engine)
    for phase in ("forward", "backward"):
        numel, calls, peak = STEADY[phase]
        assert counts[phase]["allgather_calls"] == passes[phase]["allgather_calls"] == calls
        assert counts[phase]["allgather_numel"] == passes[phase]["allgather_numel"] == numel
        assert counts[phase]["demand_numel"] == 0
        assert counts[phase]["peak_live_numel"] == passes[phase]["peak_live_numel"] == peak
    assert counts["step"]["allgather_calls"] == 0
    engine.destroy()


def test_bucket_zero_means_no_prefetch(model):
    engine = training_engine(model, zero3_config(bucket=0, reuse=0))
    run_cycles(engine, 2)
    passes = last_passes(engine)
    for kind in ("forward", "backward", "eval_forward"):
        p = passes[kind]
        assert p["allgather_calls"] == PARAM_MODULES, kind
        assert p["allgather_numel"] == MODEL_A and p["demand_numel"] == MODEL_A and p["prefetch_numel"] == 0, kind
        assert p["peak_live_numel"] == UP, kind  # one module at a time
    engine.destroy()


def test_live_parameter_cap_bounds_the_window(model):
    """stage3_max_live_parameters caps prefetching: with 300k the window never adds a second Linear."""
    engine = training_engine(model, zero3_config(bucket=1_000_000, reuse=0, max_live=300_000))
    run_cycles(engine, 2)
    passes = last_passes(engine)
    for kind in ("forward", "backward", "eval_forward"):
        p = passes[kind]
        # Nothing is kept: cap - bucket leaves no room for the backward, and reuse 0 keeps nothing across passes.
        assert (p["allgather_numel"], p["allgather_calls"], p["demand_numel"]) == (MODEL_A, PARAM_MODULES - 2, 0), kind
    # Beyond the module in use, one prefetched module is live (the cap is checked before each module): forward
    # and eval peak at inp + the first block (its up prefetched with inp, its down once inp is released);
    # backward at the head + the last block.
    assert [passes[k]["peak_live_numel"] for k in ("forward", "backward", "eval_forward")] == [
        INP + UP + DOWN, HEAD + DOWN + UP, INP + UP + DOWN]
    engine.destroy()


def test_default_reuse_distance_keeps_parameters_for_backward(model):
    """Upstream's default reuse distance (1e9) keeps what backward reuses: fewer gathers, within the live cap."""
    engine = training_engine(model, zero3_config(bucket=100_000, reuse=1_000_000_000, max_live=1_000_000_000))
    run_cycles(engine, 3)
    passes = last_passes(engine)
    # The eval forward after the step gathers the model and keeps it for the next forward ([Note: keeping across
    # no-grad passes]); the training forward uses it and keeps it for its backward.
    assert passes["eval_forward"]["allgather_numel"] == MODEL_A
    assert passes["forward"]["allgather_numel"] == 0
    assert passes["backward"]["allgather_numel"] == 0  # everything was kept from the forward
    assert passes["backward"]["demand_numel"] == 0
    assert passes["forward"]["peak_live_numel"] == MODEL_A  # what the reuse distance deliberately keeps
    engine.destroy()


def test_reuse_distance_respects_live_cap(model):
    engine = training_engine(model, zero3_config(bucket=100_000, reuse=1_000_000_000, max_live=3_000_000))
    run_cycles(engine, 3)
    passes = last_passes(engine)
    counts = {k: (p["allgather_numel"], p["demand_numel"], p["peak_live_numel"]) for k, p in passes.items()}
    # The eval forward keeps the first 2,895,360 numel of the model (inp, five blocks and the sixth's up) for the
    # next forward ([Note: keeping across no-grad passes]), which gathers only the rest and keeps its tail for the
    # backward ([Note: budgeted keeping]). Filling the cap, the kept prefix leaves the eval forward no room to
    # prefetch the rest: 1,575,428 of it comes on demand.
    kept_for_forward = INP + 5 * (UP + DOWN) + UP
    assert counts == {
        "forward": (MODEL_A - kept_for_forward, 0, 3_157_760),
        "backward": (3_420_928, 0, 3_154_436),
        "eval_forward": (MODEL_A, 1_575_428, 3_158_528),
    }
    engine.destroy()
