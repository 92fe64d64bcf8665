"""[Note: the end of a backward]: a backward pass closes when its autograd graph task completes, on every supported
release (stage 3 calls ``release_backward_leftovers`` after ``engine.backward()`` only from 0.19.3), and for a
direct ``loss.backward()`` too."""

import torch

import deepspeed_zero3
from deepspeed_zero3.runtime.zero.stats_api import coordinator_of
from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import count_params, model_b


def closed(engine):
    coordinator = coordinator_of(engine)
    return coordinator.running is None, coordinator.live_numel


def test_engine_backward_leaves_nothing_gathered_before_step():
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    for step in range(3):
        loss = mse_loss(engine(batch(step, rank)))
        engine.backward(loss)
        assert closed(engine) == (True, 0), step
        passes = deepspeed_zero3.get_zero3_stats(engine)["passes"]
        assert [p["kind"] for p in passes[-2:]] == ["forward", "backward"], step
        # Between backward and step the weights can be streamed: no pass is running.
        streamed = sum(tensor.numel() for _, tensor in deepspeed_zero3.iter_gathered_parameters(engine))
        assert streamed == count_params(engine.module) == 199_876
        engine.step()
    engine.destroy()


def test_a_direct_loss_backward_closes_its_pass():
    """Nothing of stage 3 runs after a plain ``loss.backward()`` on any release: the graph task's end closes it."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    loss = mse_loss(engine(batch(0, rank)))
    loss.backward()
    assert closed(engine) == (True, 0)
    last = deepspeed_zero3.get_zero3_stats(engine)["passes"][-1]
    assert (last["kind"], last["allgather_numel"], last["trace_records"]) == ("backward", 199_876 - 16_708, 1)
    # stage 3's own epilogue, where the release has one, then finds no backward to close.
    engine.optimizer.parameter_offload.release_backward_leftovers()
    assert len(deepspeed_zero3.get_zero3_stats(engine)["passes"]) == 2
    engine.destroy()
