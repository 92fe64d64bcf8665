"""nn.Module.training decides nothing: eval-mode and frozen submodules train, and flipping modes changes no gather."""

import pathlib

import torch

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

RUNTIME = pathlib.Path(deepspeed_zero3.__file__).parent / "runtime"


def test_runtime_source_never_reads_training():
    offenders = [f"{path.name}:{n}" for path in RUNTIME.rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if ".training" in line and not line.lstrip().startswith("#") and "nn.Module.training" not in line]
    assert offenders == []


def run(engine, steps, rank, mode_flips):
    losses = []
    for step in range(steps):
        mode_flips(engine)
        loss = mse_loss(engine(batch(step, rank)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_eval_mode_frozen_and_whole_model_eval_train_identically():
    """Modes change no loss (the model has no dropout or batchnorm) and no gather count."""
    rank = torch.distributed.get_rank()
    results = {}
    for label, flips in {
            "train": lambda e: e.train(),
            "whole_model_eval": lambda e: e.eval(),
            "half_eval": lambda e: [b.eval() for b in e.module.blocks[:3]],
            "alternating": lambda e: e.eval() if e.global_steps % 2 else e.train(),
    }.items():
        torch.manual_seed(0)
        engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
        results[label] = run(engine, 4, rank, flips)
        last = deepspeed_zero3.get_zero3_stats(engine)["passes"][-2:]
        # the backward: all but head + the last down, kept from the forward ([Note: budgeted keeping])
        assert [p["allgather_numel"] for p in last] == [199_876, 199_876 - 16_708], label
        assert [p["demand_numel"] for p in last] == [0, 0], label
        engine.destroy()
    assert results["whole_model_eval"] == results["train"]
    assert results["half_eval"] == results["train"]
    assert results["alternating"] == results["train"]


def test_frozen_submodules_in_eval_mode():
    """LoRA-style: most of the model frozen and in eval mode; backward still fetches what it needs."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    for block in model.blocks[:4]:
        block.requires_grad_(False)
        block.eval()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
    before = [p.ds_tensor.clone() for p in model.blocks[0].parameters()]
    losses = run(engine, 4, rank, lambda e: [b.eval() for b in e.module.blocks[:4]])
    assert all(torch.equal(a, p.ds_tensor) for a, p in zip(before, model.blocks[0].parameters(), strict=True))
    assert losses[-1] == losses[-1]
    last = deepspeed_zero3.get_zero3_stats(engine)["passes"][-2:]
    assert [p["demand_numel"] for p in last] == [0, 0]
    assert deepspeed_zero3.get_zero3_stats(engine)["live_numel"] == 0
    engine.destroy()
