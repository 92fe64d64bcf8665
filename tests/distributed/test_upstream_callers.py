"""Upstream code that reaches into the runtime keeps working: unwrap_model_for_generation."""

import torch

from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b


def test_unwrap_model_for_generation_removes_and_restores_hooks():
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    rank = torch.distributed.get_rank()
    train_step(engine, batch(0, rank))
    offload = engine.optimizer.parameter_offload
    hooks = len(offload.forward_hooks)
    assert hooks == 2 * len(list(engine.module.modules()))
    with unwrap_model_for_generation(engine) as unwrapped:
        assert offload.forward_hooks == [] and offload.backward_hooks == []
        assert all(p.numel() == p.ds_numel for p in unwrapped.parameters())  # gathered for generation
        with torch.no_grad():
            unwrapped(batch(1, rank))
    assert len(offload.forward_hooks) == hooks
    # Training goes on with the traces it had: nothing re-recorded, nothing fetched on demand.
    deepspeed_zero3.reset_zero3_stats(engine)
    train_step(engine, batch(2, rank))
    train_step(engine, batch(3, rank))
    last = deepspeed_zero3.get_zero3_stats(engine)["passes"][-2:]
    assert [p["demand_numel"] for p in last] == [0, 0]
    assert [p["trace_records"] for p in last] == [0, 0]
    engine.destroy()
