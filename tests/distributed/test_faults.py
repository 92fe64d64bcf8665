"""A failed or abandoned step leaves nothing gathered, and training continues as if it never happened."""

import pytest
import torch

import deepspeed
import deepspeed_zero3
from deepspeed_zero3.testing.engines import (batch, gathered_copies, inference_engine, mse_loss, train_step,
                                             training_engine, zero3_config)
from deepspeed_zero3.testing.models import MODEL_B_NUMEL, model_b

CONFIG = zero3_config(bucket=20_000, reuse=0)
# Block 3 of Model B (up 16,640 + down 16,448): prefetched for the backward that fails just before it.
BACKWARD_PREFETCH_AT_FAULT = 33_088
MODEL_B = MODEL_B_NUMEL  # numel of every non-persistent parameter


class Boom(RuntimeError):
    pass


def rank():
    return torch.distributed.get_rank()


def final_params(engine):
    return gathered_copies(engine.module.parameters())


def assert_matches(engine, losses, expected_losses, expected_params) -> None:
    """Bitwise the run that skipped the faulted step: every loss, then every final parameter."""
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(final_params(engine), expected_params, strict=True))


def assert_last_pass_aborted(engine, kind: str) -> None:
    last = deepspeed_zero3.get_zero3_stats(engine)["passes"][-1]
    assert last["kind"] == kind and last["aborted"] is True, last


def assert_replayed(engine, last: int) -> None:
    """The last ``last`` passes replayed recorded traces: no re-record, nothing fetched on demand."""
    for p in deepspeed_zero3.get_zero3_stats(engine)["passes"][-last:]:
        assert p["trace_records"] == 0 and p["demand_numel"] == 0, p


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
    assert_last_pass_aborted(engine, "forward")
    losses += [train_step(engine, batch(s, rank())) for s in (3, 4)]
    assert_matches(engine, losses, expected_losses, expected_params)
    # The trace recorded before the fault is still used: no re-record, no demand fetch.
    assert_replayed(engine, 2)
    engine.destroy()


class ExplodingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``armed``: a fault inside a custom autograd backward."""
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ExplodingBackward.armed:
            raise Boom("injected in backward")
        return grad


def model_with_exploding_backward():
    """Model B with block 3's output through ExplodingBackward: its backward fails after head, blocks 5 and 4 ran."""
    model = model_b()
    model.blocks[3].register_forward_hook(lambda module, args, output: ExplodingBackward.apply(output))
    return model


def test_exception_in_custom_autograd_backward():
    expected_losses, expected_params = clean_run([0, 1, 3, 4])
    torch.manual_seed(0)
    engine = training_engine(model_with_exploding_backward(), CONFIG)
    losses = [train_step(engine, batch(s, rank())) for s in (0, 1)]
    loss = mse_loss(engine(batch(2, rank())))
    ExplodingBackward.armed = True
    try:
        with pytest.raises(Boom, match="injected in backward"):
            engine.backward(loss)
    finally:
        ExplodingBackward.armed = False
    assert live(engine) == BACKWARD_PREFETCH_AT_FAULT
    deepspeed_zero3.abandon_step(engine)
    assert live(engine) == 0
    assert_last_pass_aborted(engine, "backward")
    losses += [train_step(engine, batch(s, rank())) for s in (3, 4)]
    assert_matches(engine, losses, expected_losses, expected_params)
    # The half-run backward recorded no trace: the next steps replay the full ones, nothing on demand.
    assert_replayed(engine, 4)
    engine.destroy()


def test_abandon_step_with_gradient_accumulation_drops_the_window_so_far():
    """gradient_accumulation_steps=2: after abandon_step the boundary step uses only the micro-batches after it,
    exactly as a window whose earlier micro-batch contributed zero gradients."""
    config = zero3_config(bucket=20_000, reuse=0, grad_accum=2)

    def micro(engine, step, scale=1.0):
        loss = mse_loss(engine(batch(step, rank())))
        engine.backward(loss * scale)
        engine.step()
        return loss.item()

    torch.manual_seed(0)
    reference = training_engine(model_with_exploding_backward(), config)
    expected = [micro(reference, 0), micro(reference, 1), micro(reference, 2, scale=0.0), micro(reference, 4),
                micro(reference, 5), micro(reference, 6)]
    expected_params = final_params(reference)
    reference.destroy()

    torch.manual_seed(0)
    engine = training_engine(model_with_exploding_backward(), config)
    losses = [micro(engine, 0), micro(engine, 1), micro(engine, 2)]
    loss = mse_loss(engine(batch(3, rank())))
    ExplodingBackward.armed = True
    try:
        with pytest.raises(Boom):
            engine.backward(loss)
    finally:
        ExplodingBackward.armed = False
    deepspeed_zero3.abandon_step(engine)
    losses += [micro(engine, 4), micro(engine, 5), micro(engine, 6)]
    assert_matches(engine, losses, expected, expected_params)
    engine.destroy()


def test_failed_backward_without_abandon_step_releases_at_next_forward(caplog):
    """No optimizer state involved (autograd.grad on an inference engine): the runtime recovers on its own."""
    torch.manual_seed(0)
    engine = inference_engine(model_with_exploding_backward(), CONFIG)

    def input_grad(step):
        # Through engine.module: upstream's engine refuses a backward of its own outputs without an optimizer.
        x = batch(step, rank()).requires_grad_()
        return torch.autograd.grad(mse_loss(engine.module(x)), x)[0]

    expected = [input_grad(s) for s in (0, 1, 3)]
    ExplodingBackward.armed = True
    try:
        with pytest.raises(Boom):
            input_grad(2)
    finally:
        ExplodingBackward.armed = False
    assert live(engine) == BACKWARD_PREFETCH_AT_FAULT  # nothing has told the runtime yet
    with caplog.at_level("WARNING"):
        got = input_grad(3)
    assert "a backward pass raised before it finished" in caplog.text
    assert "deepspeed_zero3.abandon_step(engine)" in caplog.text
    assert torch.equal(got, expected[2])
    input_grad(4)  # a backward closes when its graph task completes ([Note: the end of a backward])
    assert live(engine) == 0
    passes = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    assert [(p["kind"], p["aborted"]) for p in passes[-6:]] == [("forward", False), ("backward", True),
                                                                ("forward", False), ("backward", False),
                                                                ("forward", False), ("backward", False)]
    assert_replayed(engine, 3)
    engine.destroy()


def test_abandon_step_after_a_failed_forward():
    """abandon_step is the one call for any failed step; after a forward fault it has nothing left to do."""
    expected_losses, expected_params = clean_run([0, 2])
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, CONFIG)
    losses = [train_step(engine, batch(0, rank()))]
    handle = model.blocks[1].register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(Boom("injected")))
    with pytest.raises(Boom):
        engine(batch(1, rank()))
    handle.remove()
    deepspeed_zero3.abandon_step(engine)
    deepspeed_zero3.abandon_step(engine)  # idempotent
    assert live(engine) == 0
    losses.append(train_step(engine, batch(2, rank())))
    assert_matches(engine, losses, expected_losses, expected_params)
    engine.destroy()


def test_abandoned_step_between_forward_and_backward():
    expected_losses, expected_params = clean_run([0, 1, 3, 4])
    torch.manual_seed(0)
    engine = training_engine(model_b(), CONFIG)
    losses = [train_step(engine, batch(s, rank())) for s in (0, 1)]
    loss = mse_loss(engine(batch(2, rank())))  # forward with grad, then the step is abandoned
    del loss
    # What the forward kept for its backward (head 260 + the last down 16,448, [Note: budgeted keeping]) until
    # the next forward starts
    assert live(engine) == 260 + 16_448
    losses += [train_step(engine, batch(s, rank())) for s in (3, 4)]
    assert live(engine) == 0
    assert_matches(engine, losses, expected_losses, expected_params)
    engine.destroy()


def test_abandon_step_after_a_forward_keeps_the_next_steps_tail():
    """abandon_step drops the forward it abandons from the forwards counted since a backward, so the next
    step's forward is the first again and keeps its tail ([Note: budgeted keeping]): that step's backward
    gathers what a step that never saw the fault gathers."""
    torch.manual_seed(0)
    engine = training_engine(model_b(), CONFIG)
    for s in (0, 1):
        train_step(engine, batch(s, rank()))
    loss = mse_loss(engine(batch(2, rank())))  # a forward with grad whose step is then abandoned
    del loss
    deepspeed_zero3.abandon_step(engine)
    assert live(engine) == 0
    train_step(engine, batch(3, rank()))
    passes = deepspeed_zero3.get_zero3_stats(engine)["passes"]
    assert [p["kind"] for p in passes] == ["forward", "backward"] * 2 + ["forward"] * 2 + ["backward"]
    steady, after = passes[3], passes[-1]
    assert after["allgather_numel"] == steady["allgather_numel"] == MODEL_B - 260 - 16_448, (steady, after)
    assert after["demand_numel"] == 0
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
