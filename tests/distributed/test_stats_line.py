"""``DEEPSPEED_ZERO3_STATS_EVERY=N`` prints one line on rank 0 every N backward passes, at the default log level
(deepspeed's logger shows only warnings, so the line is printed, not logged)."""

import torch

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b


def test_stats_line_every_two_backward_passes(monkeypatch, capfd):
    monkeypatch.setenv("DEEPSPEED_ZERO3_STATS_EVERY", "2")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=20_000, reuse=0))
    capfd.readouterr()
    expected = []
    for step in range(5):
        engine.backward(mse_loss(engine(batch(step, rank))))
        if step % 2 == 1:
            passes = deepspeed_zero3.get_zero3_stats(engine)["passes"]
            forward, backward = passes[-2], passes[-1]
            expected.append(
                f"deepspeed-zero3 stats after backward {step + 1} | "
                f"forward: {forward['allgather_calls']} gathers {forward['allgather_numel'] / 1e6:.3f}M demand "
                f"{forward['demand_numel'] / 1e6:.3f}M peak-live {forward['peak_live_numel'] / 1e6:.3f}M records "
                f"{forward['trace_records']} | "
                f"backward: {backward['allgather_calls']} gathers {backward['allgather_numel'] / 1e6:.3f}M demand "
                f"{backward['demand_numel'] / 1e6:.3f}M peak-live {backward['peak_live_numel'] / 1e6:.3f}M records "
                f"{backward['trace_records']}")
        engine.step()
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("deepspeed-zero3 stats")]
    assert lines == (expected if rank == 0 else [])
    assert len(expected) == 2
    engine.destroy()
