"""[Note: profiler ranges] in a real training step: one fetch and one release range per module run, named by
class and ds_id, a wait in every fetch, and the prefetches of a replayed step."""

import collections

import torch
import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator_module
from torch.profiler import ProfilerActivity, profile

from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import tiny_mlp


def ranges(prof):
    names = collections.Counter(event.name for event in prof.events() if event.name.startswith("ZeRO3::"))
    return {kind: sum(n for name, n in names.items() if name.startswith(f"ZeRO3::{kind} ")) for kind in
            ("fetch", "wait", "prefetch", "release")}, names


def test_a_profiled_step_names_every_fetch_and_release():
    torch.manual_seed(0)
    model = tiny_mlp()
    engine = training_engine(model, zero3_config(bucket=200, reuse=0))
    rank = torch.distributed.get_rank()
    train_step(engine, batch(0, rank, shape=(4, 8)))  # records the traces: the next step replays them
    modules_with_params = [m for m in model.modules() if list(m.parameters(recurse=False))]
    cls = coordinator_module.PartitionedParameterCoordinator
    calls = collections.Counter()
    originals = {name: getattr(cls, name) for name in ("fetch_sub_module", "release_sub_module")}

    def counted(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(cls, name, counted(name))
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            train_step(engine, batch(1, rank, shape=(4, 8)))
    finally:
        for name, original in originals.items():
            setattr(cls, name, original)
    counts, names = ranges(prof)
    assert counts["fetch"] == counts["wait"] == calls["fetch_sub_module"] > 0, names
    assert counts["release"] == calls["release_sub_module"], names
    assert counts["prefetch"] > 0, names
    first, last = modules_with_params[0], modules_with_params[-1]
    assert f"ZeRO3::fetch {type(first).__name__} ds_id={first.ds_id} forward" in names, names
    assert f"ZeRO3::release {type(last).__name__} ds_id={last.ds_id} backward" in names, names
    assert any(name.startswith("ZeRO3::prefetch backward start (") for name in names), names
    engine.destroy()
