"""[Note: upstream's event timings]: ``ENABLE_PROFILER = True`` gives upstream's profiler events over our own fetches,
waits, prefetches and all-gathers, counted exactly as the per-pass stats count them, and upstream's log lines."""

import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator_module
import deepspeed.runtime.zero.partitioned_param_profiler as profiler_module
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import tiny_mlp


def test_enable_profiler_counts_our_gathers_and_logs_them_as_upstream_does(monkeypatch):
    monkeypatch.setattr(coordinator_module, "ENABLE_PROFILER", True)
    lines = []
    monkeypatch.setattr(profiler_module, "log_dist", lambda message, ranks=None: lines.append(message))
    torch.manual_seed(0)
    model = tiny_mlp()
    config = dict(zero3_config(bucket=200, reuse=0), wall_clock_breakdown=True)
    engine = training_engine(model, config)
    rank = torch.distributed.get_rank()
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    train_step(engine, batch(0, rank, shape=(4, 8)))  # records the traces (replaying the first-pass guess)
    deepspeed_zero3.reset_zero3_stats(engine)
    train_step(engine, batch(1, rank, shape=(4, 8)))  # replays them
    counters = {name: (c.count, c.num_elem) for name, c in coordinator.events.profiler.event_counters.items()}
    passes = {p["kind"]: p for p in deepspeed_zero3.get_zero3_stats(engine)["passes"]}
    forward, backward = passes["forward"], passes["backward"]
    # One all-gather event per collective, with the numel the stats count.
    assert counters["forward_all_gather"] == (forward["allgather_calls"], forward["allgather_numel"]), counters
    assert counters["backward_all_gather"] == (backward["allgather_calls"], backward["allgather_numel"]), counters
    assert counters["forward_prefetch_submit"][1] == forward["prefetch_numel"], counters
    assert counters["backward_prefetch_submit"][1] == backward["prefetch_numel"], counters
    lines.clear()  # step 0's, logged when step 1's forward began
    engine(batch(2, rank, shape=(4, 8)))  # the next forward logs the replayed step's counters, then resets them
    assert lines == [f"{name}: count = {count}, numel = {numel}" for name, (count, numel) in counters.items()], lines
    engine.destroy()
