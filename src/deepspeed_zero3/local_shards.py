"""``deepspeed_zero3.iter_local_shards``: this rank's partition of every parameter, with no collective.

    for shard in deepspeed_zero3.iter_local_shards(engine):     # on any rank, alone
        send(shard.name, shard.offset, shard.tensor)             # a resharding receiver stitches them

A ZeRO-3 partition is a contiguous slice of the flattened parameter: the parameter is padded to a multiple of its
partition group's size, and rank ``r`` of that group holds elements ``[r * n, (r + 1) * n)`` of the padded, flattened
tensor (``n`` = the partition's numel). A shard states that slice: ``offset`` into the flattened full tensor,
``tensor`` (a view of the partition, padding cut off: no copy), ``padding`` (how many elements of the partition lie
past the parameter's end, on the last ranks), the full ``shape`` and the ``dtype``. Every rank's shards, put at their
offsets, are the full tensors, exactly what ``GatheredParameters`` gathers (``tests/distributed/test_local_shards.py``).

Nothing here is a collective: the partition rank is read from the parameter's process group. A rank may iterate
alone, as often as it likes, at any point between steps. The views alias the live partitions: the optimizer's
``step()`` writes into them, so copy what must outlive the next step.

With CPU parameter offload the partitions are in host memory and are read as they are. With NVMe parameter offload
(``offload_param.device: nvme``) a partition stored on NVMe is not in memory: it is refused, before anything is
yielded, naming the parameter (the stream, ``iter_gathered_parameters``, reads NVMe). Quantized partitions (ZeRO++
``zero_quantized_nontrainable_weights``) hold quantized values, not the parameter's, and are refused the same way.
A parameter attached after ``initialize`` is not partitioned: its shard is the whole tensor on every rank,
``replicated=True``.
"""

import dataclasses
from typing import Iterator, List, Tuple

import torch
from torch.nn import Module


@dataclasses.dataclass(frozen=True)
class LocalShard:
    """One parameter's partition on this rank (``iter_local_shards``)."""
    name: str
    tensor: torch.Tensor  # a view of the partition, padding cut off (may be empty on the last ranks)
    offset: int  # where ``tensor`` starts in the flattened full tensor
    shape: Tuple[int, ...]  # the full tensor's shape
    dtype: torch.dtype
    padding: int  # elements of this rank's partition past the parameter's end (not in ``tensor``)
    replicated: bool = False  # not partitioned: every rank holds all of it (a module attached after initialize)

    @property
    def numel(self) -> int:
        """The full tensor's numel."""
        return int(torch.Size(self.shape).numel())


def iter_local_shards(model_or_engine) -> Iterator[LocalShard]:
    """This rank's ``LocalShard`` of every parameter of a ZeRO-3 model, in ``named_parameters()`` order (a tied
    parameter once, under its first name). No collective; see the module's docstring."""
    from deepspeed_zero3.weights import stream_module

    module = stream_module(model_or_engine, api="iter_local_shards")
    named = list(module.named_parameters())
    _refuse_unpartitioned_model(module, named)
    _refuse_partitions_not_in_memory(named)
    return _shards(named)


def _shards(named: List[Tuple[str, torch.nn.Parameter]]) -> Iterator[LocalShard]:
    import torch.distributed as dist

    for name, param in named:
        if not hasattr(param, "ds_id"):
            yield LocalShard(name, param.detach().view(-1), 0, tuple(param.shape), param.dtype, 0, replicated=True)
            continue
        partition = param.ds_tensor
        size = int(partition.ds_numel)
        offset = size * dist.get_rank(group=param.ds_process_group)
        valid = max(0, min(size, param.ds_numel - offset))
        yield LocalShard(name, partition.detach().view(-1).narrow(0, 0, valid), offset, tuple(param.ds_shape),
                         param.dtype, size - valid)


def _refuse_unpartitioned_model(module: Module, named) -> None:
    if named and not any(hasattr(param, "ds_id") for _, param in named):
        raise ValueError(f"iter_local_shards expects a ZeRO-3 model: parameter {named[0][0]!r} of "
                         f"{type(module).__name__} is not partitioned (no ds_id), nor is any other. Pass the model "
                         f"after deepspeed.initialize with zero_optimization.stage 3, or the engine itself.")


def _refuse_partitions_not_in_memory(named) -> None:
    from deepspeed_zero3.runtime.zero.nvme_swap import on_nvme

    on_disk = [name for name, param in named if hasattr(param, "ds_id") and on_nvme(param)]
    if on_disk:
        raise ValueError(f"iter_local_shards: {len(on_disk)} parameter partition(s) live on NVMe "
                         f"(offload_param.device: nvme), first {on_disk[0]!r}; local shards are read from memory only "
                         f"and are not swapped in. Use deepspeed_zero3.iter_gathered_parameters, which reads NVMe, or "
                         f"offload_param.device: cpu.")
    quantized = [name for name, param in named
                 if hasattr(param, "ds_id") and hasattr(param.ds_tensor, "ds_quant_scale")]
    if quantized:
        raise ValueError(f"iter_local_shards: {len(quantized)} parameter partition(s) are quantized "
                         f"(zero_quantized_nontrainable_weights), first {quantized[0]!r}: they hold quantized values, "
                         f"not the parameter's. Use deepspeed_zero3.iter_gathered_parameters, which dequantizes.")
