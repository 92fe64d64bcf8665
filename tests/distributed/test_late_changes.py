"""Changes to the model after ``deepspeed.initialize``: a late submodule runs as plain PyTorch (with a warning);
a replaced parameter is refused with an error that says what to do. Upstream 0.19.8 crashes on both with an
AttributeError inside its coordinator (measured with DEEPSPEED_ZERO3=0: ``'Parameter' object has no attribute
'ds_active_sub_modules'`` at step(), ``... no attribute 'ds_id'`` at the next forward)."""

import pytest
import torch

import deepspeed
import deepspeed.runtime.engine
import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, gathered_copies, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

CONFIG = zero3_config(bucket=20_000, reuse=0)


def rank():
    return torch.distributed.get_rank()


class WithTail(torch.nn.Module):
    """Model B followed by ``tail``: a module attached later, or the same affine map as a plain function."""

    def __init__(self):
        super().__init__()
        self.body = model_b()
        self.tail = None
        self.tail_fn = None

    def forward(self, x):
        h = self.body(x)
        if self.tail is not None:
            h = self.tail(h)
        if self.tail_fn is not None:
            h = self.tail_fn(h)
        return h


def body_params(engine):
    return gathered_copies(engine.module.body.parameters())


def late_linear():
    torch.manual_seed(5)
    return torch.nn.Linear(4, 4)


# Before 0.19.1 the engine sets ``_in_forward`` on every module's ``_parameters`` unguarded: a module attached after
# initialize (a plain dict there) fails inside upstream's engine, with either runtime.
@pytest.mark.skipif(not hasattr(deepspeed.runtime.engine, "ensure_zero_ordered_dict"),
                    reason="this deepspeed release's engine cannot run a module attached after initialize (from 0.19.1)")
def test_late_attached_submodule_runs_as_plain_pytorch(caplog):
    # Reference: the same affine map applied by a function, never a module or a parameter.
    torch.manual_seed(0)
    reference = training_engine(WithTail(), CONFIG)
    ref_losses = [train_step(reference, batch(0, rank()))]
    tail = late_linear()
    weight, bias = tail.weight.detach().clone(), tail.bias.detach().clone()
    reference.module.tail_fn = lambda h: torch.nn.functional.linear(h, weight, bias)
    ref_losses += [train_step(reference, batch(s, rank())) for s in (1, 2, 3)]
    ref_params = body_params(reference)
    reference.destroy()

    torch.manual_seed(0)
    engine = training_engine(WithTail(), CONFIG)
    losses = [train_step(engine, batch(0, rank()))]
    engine.module.tail = late_linear()
    with caplog.at_level("WARNING"):
        losses += [train_step(engine, batch(s, rank())) for s in (1, 2, 3)]
    assert "parameter 'weight' of Linear was added after deepspeed.initialize" in caplog.text
    assert "not sharded), and the engine's optimizer does not train it" in caplog.text
    assert caplog.text.count("was added after deepspeed.initialize") == 2  # weight and bias, once each
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(body_params(engine), ref_params, strict=True))
    # As in PyTorch for a module added after its optimizer: whole on every rank and never stepped.
    assert torch.equal(engine.module.tail.weight, weight) and not hasattr(engine.module.tail.weight, "ds_id")
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()


def test_replaced_parameter_is_refused_with_what_to_do():
    torch.manual_seed(0)
    model = WithTail()
    engine = training_engine(model, CONFIG)
    losses = [train_step(engine, batch(0, rank()))]
    head = model.body.head
    original = head.weight
    head.weight = torch.nn.Parameter(torch.zeros(4, 64))
    with pytest.raises(RuntimeError) as info:
        engine(batch(1, rank()))
    message = str(info.value)
    assert (f"deepspeed-zero3: parameter 'weight' of module Linear (ds_id={head.ds_id}) is not a ZeRO-3 parameter: "
            "it was assigned after deepspeed.initialize (shape (4, 64))") in message
    assert ("`with deepspeed.zero.GatheredParameters(module.weight, modifier_rank=0), torch.no_grad(): "
            "module.weight.copy_(new)`") in message
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0

    # What the message says to do: write the new values into the partitioned parameter.
    head.weight = original
    with deepspeed.zero.GatheredParameters(head.weight, modifier_rank=0), torch.no_grad():
        if rank() == 0:
            head.weight.copy_(torch.zeros(4, 64))
    with torch.no_grad():
        out = engine(batch(1, rank()))
    assert torch.equal(out, gathered_copies([head.bias])[0].expand(4, 4))  # a zero weight on every rank: the output is the bias
    losses.append(train_step(engine, batch(2, rank())))
    assert all(loss > 0 for loss in losses)
    engine.destroy()
