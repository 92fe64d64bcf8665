"""``deepspeed_zero3.iter_local_shards``: this rank's partitions with no collective; every rank's, stitched at their
offsets, equal what ``GatheredParameters`` gathers, bit for bit.

Model B (199,876 parameters; testing/models.py) after a training step. At world size 2 every parameter splits
evenly but the head's bias (4 elements: 2 each); at world size 4 the inp and down biases (64: 16 each) split evenly
and the head's bias (4: 1 each) too, while an odd size (a Linear(3, 5) of 15 + 5) leaves padding on the last rank.
"""

import sys
from pathlib import Path

import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.collectives import parameter_gathers
from deepspeed_zero3.testing.engines import batch, gathered_copies, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from scenarios_nvme import nvme_config, nvme_model, nvme_unavailable, swap_dir_for_all_ranks  # noqa: E402


class WithOddSizes(torch.nn.Module):
    """Model B and a Linear(3, 5): 15 and 5 elements, which no world size above 1 here divides."""

    def __init__(self):
        super().__init__()
        self.body = model_b()
        self.odd = torch.nn.Linear(3, 5)

    def forward(self, x):
        return self.body(x) + self.odd(x[:, :3]).sum(dim=1, keepdim=True)


def stitched(shards_of_every_rank):
    """The full tensors from every rank's (name, offset, values, shape, padding, replicated) records."""
    full, shapes = {}, {}
    for records in shards_of_every_rank:
        for name, offset, values, shape, _padding, replicated in records:
            shapes[name] = shape
            numel = int(torch.Size(shape).numel())
            target = full.setdefault(name, torch.full((numel, ), float("nan"), dtype=values.dtype))
            if replicated:
                target.copy_(values)
            else:
                target[offset:offset + values.numel()] = values
    return {name: tensor.view(shapes[name]) for name, tensor in full.items()}


def check_stitched_equals_gathered(config):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = WithOddSizes()
    engine = training_engine(model, config)
    train_step(engine, batch(0, rank))
    gathers_before = deepspeed_zero3.get_zero3_stats(engine)["outside_pass"]["allgather_calls"]
    with parameter_gathers() as counted:
        shards = list(deepspeed_zero3.iter_local_shards(engine))
    assert counted["calls"] == 0
    assert deepspeed_zero3.get_zero3_stats(engine)["outside_pass"]["allgather_calls"] == gathers_before
    assert [s.name for s in shards] == [name for name, _ in model.named_parameters()]
    for shard, (_, param) in zip(shards, model.named_parameters()):
        assert shard.tensor.untyped_storage().data_ptr() == param.ds_tensor.untyped_storage().data_ptr()  # a view
        assert shard.shape == tuple(param.ds_shape) and shard.dtype == param.dtype and not shard.replicated
        assert shard.offset == rank * param.ds_tensor.ds_numel
        assert shard.tensor.numel() + shard.padding == param.ds_tensor.ds_numel
    odd_weight = next(s for s in shards if s.name == "odd.weight")
    per_rank = -(-15 // world)
    assert odd_weight.padding == max(0, min(per_rank, (rank + 1) * per_rank - 15))
    records = [(s.name, s.offset, s.tensor.clone(), s.shape, s.padding, s.replicated) for s in shards]
    everyone = [None] * world
    torch.distributed.all_gather_object(everyone, records)
    full = stitched(everyone)
    expected = gathered_copies(model.parameters())
    for (name, _), value in zip(model.named_parameters(), expected, strict=True):
        assert torch.equal(full[name], value), name
    engine.destroy()


def test_stitched_shards_equal_the_gathered_parameters():
    check_stitched_equals_gathered(zero3_config(bucket=20_000, reuse=0))


@pytest.mark.world_size(4)
def test_stitched_shards_equal_the_gathered_parameters_at_world_size_4():
    check_stitched_equals_gathered(zero3_config(bucket=20_000, reuse=0))


def test_with_cpu_parameter_offload():
    check_stitched_equals_gathered(zero3_config(bucket=20_000, reuse=0, offload_param={"device": "cpu"}))


def test_a_module_attached_after_initialize_is_whole_on_every_rank():
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
    model.extra = torch.nn.Linear(2, 2)
    shards = {s.name: s for s in deepspeed_zero3.iter_local_shards(model)}
    extra = shards["extra.weight"]
    assert extra.replicated and extra.offset == 0 and extra.padding == 0 and extra.shape == (2, 2)
    assert torch.equal(extra.tensor, model.extra.weight.detach().view(-1))
    engine.destroy()


def test_bad_input_is_refused_naming_it():
    with pytest.raises(TypeError, match=r"iter_local_shards expects the engine deepspeed.initialize returned, or its "
                                        r"model \(an nn.Module\); got str"):
        deepspeed_zero3.iter_local_shards("model")
    with pytest.raises(ValueError, match=r"iter_local_shards expects a ZeRO-3 model: parameter 'weight' of Linear is "
                                         r"not partitioned"):
        deepspeed_zero3.iter_local_shards(torch.nn.Linear(2, 2))


def test_nvme_parameter_offload_is_refused_before_anything_is_yielded():
    """Partitions stored on NVMe are not in memory: the call refuses at once, naming the first such parameter and
    what to use instead; it reads and gathers nothing."""
    import shutil

    if nvme_unavailable():
        pytest.skip(nvme_unavailable())
    swap_dir = swap_dir_for_all_ranks()
    try:
        torch.manual_seed(21)
        engine = training_engine(nvme_model(), nvme_config(swap_dir, bucket=5_000_000, buffer_count=2))
        with parameter_gathers() as counted:
            with pytest.raises(ValueError, match=r"iter_local_shards: 4 parameter partition\(s\) live on NVMe "
                                                 r"\(offload_param.device: nvme\), first 'blocks.0.up.weight'; local "
                                                 r"shards are read from memory only and are not swapped in"):
                deepspeed_zero3.iter_local_shards(engine)
        assert counted["calls"] == 0
        engine.destroy()
    finally:
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(swap_dir, ignore_errors=True)
