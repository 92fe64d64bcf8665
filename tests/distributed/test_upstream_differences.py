"""The two places where ours deliberately does what upstream's own tests say it must not
(docs/compat/upstream-differences.md), pinned with exact counts so that neither can drift silently.
The values are compared with upstream bitwise in the parity scenarios of tests/parity/scenarios_differences.py."""

import sys
from pathlib import Path

import pytest
import torch

import deepspeed_zero3
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils import set_z3_leaf_modules
from deepspeed_zero3.testing.engines import batch, training_engine, zero3_config

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from scenarios_differences import STAGE3_REFUSES_NO_GRAD_LEAF, CounterLeaf  # noqa: E402


def counts(engine):
    return [(p["kind"], p["allgather_numel"], p["demand_numel"]) for p in deepspeed_zero3.get_zero3_stats(engine)["passes"]]


@pytest.mark.skipif(STAGE3_REFUSES_NO_GRAD_LEAF, reason="this deepspeed release's stage 3 refuses a z3 leaf whose "
                    "inputs need no grad (until 0.18.0), under either runtime")
def test_a_z3_leaf_root_trains_on_inputs_that_need_no_grad():
    """Upstream's TestSetZ3LeafModule::test_no_grad_input_error expects a RuntimeError here (upstream's backward
    finds the leaf's weights released). Ours fetches the leaf for its backward from its outputs' gradients and
    releases it when the backward ends: the forward gathers both Linears (2,048; on demand, as for any root: nothing
    runs before the root to prefetch it), the backward nothing (the model is smaller than one bucket, so the forward
    keeps it, [Note: budgeted keeping])."""
    torch.manual_seed(61)
    model = CounterLeaf()
    set_z3_leaf_modules(model, [CounterLeaf])
    engine = training_engine(model, zero3_config(bucket=32 * 32, reuse=0))
    for step in range(3):
        x = batch(step, torch.distributed.get_rank(), shape=(4, 32))
        assert not x.requires_grad
        loss = engine(x, torch.arange(4) + step)[1]
        engine.backward(loss)
        engine.step()
        assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    assert counts(engine) == [("forward", 2_048, 2_048), ("backward", 0, 0)] * 3
    engine.destroy()


def test_a_single_linear_root_keeps_its_weight_for_the_backward():
    """Upstream's TestZero3LinearDirectInit::test_wrapper_and_parameter_storage_lifecycle asserts the weight is
    released right after the first forward. Ours keeps it for the backward, which needs it at once (a model
    smaller than one bucket is kept whole, from the first step on): one gather per step instead of two."""
    torch.manual_seed(62)
    model = torch.nn.Linear(16, 8)
    engine = training_engine(model, zero3_config(bucket=50_000_000, reuse=0, memory_efficient_linear=True))
    for step in range(3):
        loss = engine(batch(step, torch.distributed.get_rank())).square().mean()
        assert model.weight.ds_status == ZeroParamStatus.AVAILABLE and model.weight.numel() == 16 * 8
        engine.backward(loss)
        engine.step()
        assert model.weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    assert counts(engine) == [("forward", 136, 136), ("backward", 0, 0)] * 3  # the root: on demand
    engine.destroy()
