"""First passes replay a guess ([Note: first-pass prediction]): nothing is fetched on demand from the first step.

Model A (6,312,196 parameters, bucket 100,000) and Model B (199,876, bucket 20,000), reuse 0, two ranks.
Without a guess the first forward, the first backward and the first eval forward each fetched the whole
model on demand. Now every first pass gathers exactly what a steady-state pass does, all ahead of use,
and still records its observed order once (the guess itself is never cached).
"""

import traceback

import pytest
import torch

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.testing.engines import (batch, gathered_copies, inference_engine, mse_loss, training_engine,
                                             zero3_config)
from deepspeed_zero3.testing.models import LeafBranches, ReadsAhead, ResidualMLPBlock, model_a, model_b

# model, bucket, and per pass kind: (gathered numel, all-gather calls, peak live numel). Forward and eval
# forward: the whole model; peak = the module in use + the window. Backward: what the forward did not keep,
# the kept head + last down being back within one bucket ([Note: budgeted keeping]); peak = kept + the
# first window (A: up 11; B: up 5 + down 4).
MODELS = {
    "A": (model_a, 100_000, {"forward": (6_312_196, 25, 525_568), "eval_forward": (6_312_196, 25, 525_568),
                             "backward": (6_312_196 - 263_428, 24, 263_428 + 263_168)}),
    "B": (model_b, 20_000, {"forward": (199_876, 12, 49_728), "eval_forward": (199_876, 12, 49_728),
                            "backward": (199_876 - 16_708, 11, 16_708 + 16_640 + 16_448)}),
}


def passes(engine):
    return deepspeed_zero3.get_zero3_stats(engine)["passes"]


def raised_in_upstream_stage3(error: BaseException) -> bool:
    """Whether ``error`` was raised by upstream's stage-3 optimizer itself (its innermost frame is there)."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.replace("\\", "/").endswith("deepspeed/runtime/zero/stage3.py")


def train(engine, step):
    engine.backward(mse_loss(engine(batch(step, torch.distributed.get_rank()))))
    engine.step()


def eval_forward(engine, step):
    engine.eval()
    with torch.no_grad():
        out = engine(batch(step, torch.distributed.get_rank()))
    engine.train()
    return out


def assert_steady(records, expected, recorded):
    for p, record in zip(records, recorded, strict=True):
        numel, calls, peak = expected[p["kind"]]
        assert p["demand_numel"] == 0, p
        assert p["allgather_numel"] == p["prefetch_numel"] == numel, p
        assert p["allgather_calls"] == calls and p["peak_live_numel"] == peak, p
        assert p["trace_mismatches"] == 0 and p["trace_records"] == record, p


@pytest.mark.parametrize("name", sorted(MODELS))
def test_train_eval_alternation_from_the_first_step(name):
    """Forward (registration order), backward (its reverse), eval forward (the training forward's order)."""
    make, bucket, expected = MODELS[name]
    torch.manual_seed(0)
    engine = training_engine(make(), zero3_config(bucket=bucket, reuse=0))
    for step in range(2):
        train(engine, step)
        eval_forward(engine, step)
    records = passes(engine)
    assert [p["kind"] for p in records] == ["forward", "backward", "eval_forward"] * 2
    assert_steady(records, expected, recorded=[1, 1, 1, 0, 0, 0])
    engine.destroy()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_first_eval_after_training_steps(name):
    make, bucket, expected = MODELS[name]
    torch.manual_seed(0)
    engine = training_engine(make(), zero3_config(bucket=bucket, reuse=0))
    for step in range(3):
        train(engine, step)
    eval_forward(engine, 0)
    train(engine, 3)  # and the training forward after it replays its own trace, not the eval's
    records = passes(engine)
    assert [p["kind"] for p in records] == ["forward", "backward"] * 3 + ["eval_forward", "forward", "backward"]
    assert_steady(records, expected, recorded=[1, 1] + [0] * 4 + [1, 0, 0])
    engine.destroy()


def test_inference_engine_first_forward_and_z3_leaves():
    """An inference engine's first forward follows registration order; a z3 leaf is one module of the guess."""
    make, bucket, expected = MODELS["B"]
    torch.manual_seed(0)
    engine = inference_engine(make(), zero3_config(bucket=bucket, reuse=0))
    eval_forward(engine, 0)
    eval_forward(engine, 1)
    assert_steady(passes(engine), expected, recorded=[1, 0])
    engine.destroy()

    torch.manual_seed(0)
    model = make()
    deepspeed.utils.set_z3_leaf_modules(model, [ResidualMLPBlock])
    engine = training_engine(model, zero3_config(bucket=bucket, reuse=0))
    train(engine, 0)
    eval_forward(engine, 0)
    records = passes(engine)
    # inp, 6 leaf blocks (each fetched at once: up + down), head: 8 modules; the first call covers inp and block 0.
    # The forward keeps head + the whole last block (one module now, 260 + 33,088) for the backward.
    forward = (199_876, 7, 2 * 33_088)
    leaf = {"forward": forward, "eval_forward": forward, "backward": (199_876 - 33_348, 6, 33_348 + 33_088)}
    assert_steady(records, leaf, recorded=[1, 1, 1])
    engine.destroy()


class Route(torch.nn.Module):
    """Three 16x16 layers run in the order ``route`` names: registration order a, b, c."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({name: torch.nn.Linear(16, 16) for name in "abc"})

    def forward(self, x, route):
        for name in route:
            x = self.layers[name](x)
        return x


LAYER = 16 * 16 + 16


@pytest.mark.parametrize("route, demand", [
    ("cab", 2 * LAYER),  # run order differs from registration order: c (the miss) and b on demand; a was prefetched
    ("abca", LAYER),  # a module run twice: its second use is a miss, fetched on demand
])
def test_a_guess_that_misses_fetches_on_demand_and_records_what_ran(route, demand):
    torch.manual_seed(0)
    model = Route()
    engine = inference_engine(model, zero3_config(bucket=LAYER, reuse=0))
    x = batch(0, torch.distributed.get_rank())
    with torch.no_grad():
        out = engine(x, route)
        engine(x, route)
    first, second = passes(engine)
    assert first["trace_mismatches"] == 1 and first["trace_records"] == 1, first
    assert first["demand_numel"] == demand, first
    assert first["allgather_numel"] == len(route) * LAYER, first
    # The observed order was recorded: the second pass replays it and fetches nothing on demand.
    assert second["trace_mismatches"] == 0 and second["trace_records"] == 0 and second["demand_numel"] == 0, second
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0

    layers = {name: gathered_copies(model.layers[name].parameters()) for name in "abc"}
    expected = x
    for name in route:
        weight, bias = layers[name]
        expected = torch.nn.functional.linear(expected, weight, bias)
    assert torch.equal(out, expected)
    engine.destroy()


def test_a_leaf_container_is_gathered_by_the_getter_not_prefetched():
    """The registration guess leaves out a leaf that cannot run a forward ([Note: first-pass prediction]): its
    parameters are gathered by ``ZeROOrderedDict``'s getter as they are read, and registered as the root's
    external parameters, as upstream does. The guess used to prefetch them for the leaf, whose fetch never
    comes, and the getter handed the forward a parameter still in flight (``mat2 must be a matrix``)."""
    torch.manual_seed(0)
    model = LeafBranches()
    deepspeed.utils.set_z3_leaf_modules(model, [torch.nn.ModuleList])
    engine = training_engine(model, zero3_config(bucket=1_000, reuse=0))

    def records():
        return [(p["kind"], p["allgather_calls"], p["allgather_numel"], p["demand_numel"]) for p in passes(engine)]

    # Forward 0: final prefetched (272); the branches (544) through the getter, one all-gather per parameter (4),
    # counted as demand ([Note: residency]). Backward 0: the root's fetch now covers its external branches (544);
    # final was kept. From step 1 the root's own fetch, the pass's first, gathers them as its external parameters
    # (on demand: nothing runs before the root to prefetch them, as upstream), and the backward finds the whole
    # model (816 < one bucket) kept.
    expected = [("forward", 5, 816, 544), ("backward", 1, 544, 0)] + [("forward", 2, 816, 544),
                                                                       ("backward", 0, 0, 0)] * 2
    for step in range(3):
        try:
            mse_loss(engine(batch(step, torch.distributed.get_rank()))).backward()  # a user backward, as upstream's
        except AssertionError as error:
            if step == 0 or not raised_in_upstream_stage3(error):
                raise
            # 0.18.3-0.18.4 end a user backward when a count of gradient hooks reaches zero, and the count includes
            # one hook per z3 leaf module, run by the leaf's own backward: this leaf runs no forward, so its hook never
            # comes, the first backward's gradients stay in the reduce bucket and the next backward's assert there.
            # Upstream's runtime alone stops the same way (later releases end the backward with autograd's graph).
            assert records()[:2] == expected[:2]
            engine.destroy()
            pytest.xfail(f"upstream's stage-3 optimizer asserted in the backward of step {step} (a z3 leaf that runs "
                         "no forward never ends a user backward on this release); step 0 matched")
    assert records() == expected
    assert set(model._external_params.values()) == set(model.branches.parameters())  # both weights and biases
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()


def test_a_parameter_read_before_its_module_runs_is_registered_though_prefetched():
    """[Note: a parameter read while in flight] The first forward's guess has ``c.weight`` gathered ahead (one
    bucket covers the model) when the root reads it: it is registered as the root's external parameter, as
    upstream registers it (partitioned there), so the root's backward fetch holds it for the matmul's gradient."""
    torch.manual_seed(0)
    model = ReadsAhead()
    engine = training_engine(model, zero3_config(bucket=1_000, reuse=0))
    for step in range(3):
        train(engine, step)
    assert set(model._external_params.values()) == {model.c.weight}
    records = [(p["kind"], p["allgather_calls"], p["allgather_numel"], p["demand_numel"]) for p in passes(engine)]
    # Step 0: one prefetch of the whole model (544), kept for the backward. Then the root's own fetch gathers
    # c.weight (256, on demand: the pass's first fetch) and c's fetch prefetches the rest (c.bias, a).
    assert records == [("forward", 1, 544, 0), ("backward", 0, 0, 0)] + [("forward", 2, 544, 256),
                                                                         ("backward", 0, 0, 0)] * 2
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()
