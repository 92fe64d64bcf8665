"""A failed or abandoned step leaves nothing gathered, and training continues as if it never happened."""

import pytest
import torch

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, mse_loss, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

CONFIG = zero3_config(bucket=20_000, reuse=0)


class Boom(RuntimeError):
    pass


def rank():
    return torch.distributed.get_rank()


def final_params(engine):
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return [p.detach().clone() for p in engine.module.parameters()]


def clean_run(steps):
    torch.manual_seed(0)
    engine = training_engine(model_b(), CONFIG)
    losses = [train_step(engine, batch(s, rank())) for s in steps]
    params = final_params(engine)
    engine.destroy()
    return losses, params


def live(engine):
    return deepspeed_zero3.get_zero3_stats(engine)["live_numel"]


def test_exception_in_submodule_forward():
    expected_losses, expected_params = clean_run([0, 1, 3, 4])
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, CONFIG)
    losses = [train_step(engine, batch(s, rank())) for s in (0, 1)]
    original = model.blocks[3].down.forward

    def failing(x):
        raise Boom("injected")

    model.blocks[3].down.forward = failing
    with pytest.raises(Boom):
        engine(batch(2, rank()))
    model.blocks[3].down.forward = original
    assert live(engine) == 0  # the aborted forward released everything it had gathered
    last = deepspeed_zero3.get_zero3_stats(engine)["passes"][-1]
    assert last["kind"] == "forward" and last["aborted"] is True
    losses += [train_step(engine, batch(s, rank())) for s in (3, 4)]
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(final_params(engine), expected_params))
    # The trace recorded before the fault is still used: no re-record, no demand fetch.
    for p in deepspeed_zero3.get_zero3_stats(engine)["passes"][-2:]:
        assert p["trace_records"] == 0 and p["demand_numel"] == 0, p
    engine.destroy()


def test_abandoned_step_between_forward_and_backward():
    expected_losses, expected_params = clean_run([0, 1, 3, 4])
    torch.manual_seed(0)
    engine = training_engine(model_b(), CONFIG)
    losses = [train_step(engine, batch(s, rank())) for s in (0, 1)]
    loss = mse_loss(engine(batch(2, rank())))  # forward with grad, then the step is abandoned
    del loss
    assert live(engine) == 0
    losses += [train_step(engine, batch(s, rank())) for s in (3, 4)]
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(final_params(engine), expected_params))
    engine.destroy()


def test_exception_while_two_engines_share_a_module():
    expected_losses, _ = clean_run([0, 1, 2, 3])
    torch.manual_seed(0)
    model = model_b()
    trainer = training_engine(model, CONFIG)
    evaluator = deepspeed.initialize(model=model, config=CONFIG)[0]
    losses = [train_step(trainer, batch(s, rank())) for s in (0, 1)]
    original = model.head.forward
    model.head.forward = lambda x: (_ for _ in ()).throw(Boom("injected"))
    with pytest.raises(Boom):
        with torch.no_grad():
            evaluator(batch(50, rank()))
    model.head.forward = original
    assert live(trainer) == 0
    losses += [train_step(trainer, batch(s, rank())) for s in (2, 3)]
    assert losses == expected_losses
    evaluator.destroy()
    trainer.destroy()
