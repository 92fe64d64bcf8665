"""``deepspeed_zero3.save_16bit_model``: the full model from ZeRO-3 into files Hugging Face loads, through the stream.

[Note: saving through the stream]
Upstream's ``engine.save_16bit_model`` gathers module by module under ``GatheredParameters(modifier_rank=0)``
(an all-gather and a broadcast back per tensor, nothing in flight) and builds the whole state dict in rank 0's
memory. Here the weights come from the weight stream (coalesced buckets, the next in flight) and rank 0 writes
each shard as it fills: a safetensors file is written header first (every name, dtype and shape is known before
any gather) and tensor by tensor, so rank 0 holds one tensor's copy plus the stream's buckets; a ``.bin`` shard
is held until it is full. The layout is ``save_pretrained``'s: ``model.safetensors`` or
``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json`` (``pytorch_model*.bin`` with
``safe_serialization=False``), names as ``state_dict()`` gives them, persistent buffers included, shards
split as huggingface_hub splits them (``plan_shards``). A tied parameter is written once, under its first name, as
``save_pretrained`` writes it; upstream's dict holds it under every name. Values are bitwise upstream's.
Everything that can be wrong with the arguments is refused before any gather; one small all_reduce first
makes every rank refuse together when rank 0 cannot write the directory.
"""

import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch.nn import Module

from deepspeed_zero3.heap_trim import TRIM_INTERVAL_CAP, HeapTrim
from deepspeed_zero3.safetensors_file import DTYPE_NAMES, SafetensorsWriter, nbytes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_shard_size(value) -> int:
    """``max_shard_size`` in bytes: an int, or a string such as "5GB" (10**9) or "500MiB" (2**20)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"save_16bit_model: max_shard_size={value!r} is not allowed: expected a number of bytes "
                         f"(an int > 0) or a size such as '5GB' or '500MiB'")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(value)
        unit = match.group(2).upper() if match else None
        if unit not in _UNITS:
            raise ValueError(f"save_16bit_model: max_shard_size={value!r} is not allowed: expected a size such as "
                             f"'5GB', '500MB' or '2GiB' (units: {', '.join(u for u in _UNITS if u)})")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"save_16bit_model: max_shard_size={value!r} is not allowed: it must be more than 0 bytes")
    return size


@dataclass
class Entry:
    """One tensor of the saved state dict: a streamed parameter (``buffer`` None) or a persistent buffer."""
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    buffer: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        return nbytes(self.dtype, self.shape)


def _state_dict_walk(module: Module, prefix: str = ""):
    """``(prefix, module)`` in the order ``state_dict()`` visits them (a module shared by two parents twice)."""
    yield prefix, module
    for name, child in module._modules.items():
        if child is not None:
            yield from _state_dict_walk(child, f"{prefix}{name}.")


def _persistent_buffers(module: Module):
    for prefix, sub in _state_dict_walk(module):
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                yield prefix + name, buf


def plan_entries(module: Module, stream, exclude_frozen: bool, merged: bool) -> List[Entry]:
    """The saved tensors in ``state_dict()`` order: each module's parameters, then its persistent buffers."""
    params = [Entry(m.name, m.dtype, tuple(m.shape)) for m in stream.metadata()]
    if merged:
        from deepspeed_zero3.peft_merge import _base_model
        buffers = list(_persistent_buffers(_base_model(module)))
        wrapped = [name for name, _ in buffers if re.search(r"(^|\.)(base_layer|modules_to_save|original_module)\.",
                                                            name)]
        if wrapped:
            raise ValueError(f"save_16bit_model(merge_adapters=True): buffer {wrapped[0]!r} lives inside a peft "
                             f"wrapper, whose merged name this save does not derive; save without merge_adapters")
        return params + [Entry(name, buf.dtype, tuple(buf.shape), buf) for name, buf in buffers]
    order, seen = [], set()
    for prefix, sub in _state_dict_walk(module):
        for name, param in sub.named_parameters(recurse=False):
            if id(param) not in seen:  # a tied parameter once, under its first name
                seen.add(id(param))
                order.append(prefix + name)
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                order.append(Entry(prefix + name, buf.dtype, tuple(buf.shape), buf))
    streamed = {entry.name: entry for entry in params}
    entries = []
    for item in order:
        if isinstance(item, Entry):
            entries.append(item)
        elif item in streamed:
            entries.append(streamed[item])
        elif not exclude_frozen:
            raise RuntimeError(f"save_16bit_model: parameter {item!r} is in the model but not in the stream")
    return entries


def plan_shards(entries: List[Entry], max_bytes: int) -> List[List[Entry]]:
    """The entries of each shard, as huggingface_hub's ``split_state_dict_into_shards_factory`` splits them: in
    order, a new shard begins where the next tensor would pass ``max_bytes``; a tensor larger than that gets a shard
    of its own, listed where it comes, and the shard being filled goes on after it (so a shard's entries need not
    be consecutive). An empty model has one empty shard."""
    shards, current, size = [], [], 0
    for entry in entries:
        if entry.nbytes > max_bytes:
            shards.append([entry])
            continue
        if size + entry.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def shard_files(count: int, safe: bool) -> Tuple[List[str], Optional[str]]:
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    if count == 1:
        return [f"{stem}.{ext}"], None
    return [f"{stem}-{i:05d}-of-{count:05d}.{ext}" for i in range(1, count + 1)], f"{stem}.{ext}.index.json"


def _stale(save_dir: str, safe: bool, keep: List[str]) -> List[str]:
    """Files of an earlier save in the same layout that this one does not rewrite (save_pretrained removes them)."""
    stem, ext = ("model", "safetensors") if safe else ("pytorch_model", "bin")
    pattern = re.compile(rf"^{stem}(-\d{{5}}-of-\d{{5}})?\.{ext}(\.index\.json)?$")
    return [name for name in os.listdir(save_dir) if pattern.match(name) and name not in keep]


def _rank_and_world():
    import torch.distributed as tdist
    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


def _agree_on_directory(save_dir: str, rank: int, world: int) -> None:
    """Rank 0 creates ``save_dir`` and checks that it can write there; every rank learns the verdict (one
    all_reduce of one integer) before any gather, so they all refuse together."""
    problem = None
    if rank == 0:
        try:
            os.makedirs(save_dir, exist_ok=True)
            probe = os.path.join(save_dir, ".deepspeed_zero3_write_probe")
            with open(probe, "wb") as handle:
                handle.write(b"ok")
            os.remove(probe)
        except OSError as error:
            problem = f"{type(error).__name__}: {error}"
    if world > 1:
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator
        flag = torch.tensor([0 if problem is None else 1], dtype=torch.int32,
                            device=get_accelerator().current_device_name())
        dist.all_reduce(flag)
        failed = int(flag.item()) > 0
    else:
        failed = problem is not None
    if failed:
        raise ValueError(f"save_16bit_model: save_dir={save_dir!r} is not allowed: rank 0 cannot write there "
                         f"({problem or 'see rank 0'})")


def _write_shards(tensors, entries, shards, files, save_dir: str, safe: bool, rank: int, heap: HeapTrim) -> None:
    """Rank 0 writes each shard as the stream fills it, in the stream's (the model's) order: a shard's file is
    opened at its first entry and closed at its last, so an oversized tensor's own file is open beside the shard
    being filled, and no other; the other ranks iterate alike (each bucket a collective)."""
    shard_of = {id(entry): index for index, shard in enumerate(shards) for entry in shard}
    left = [len(shard) for shard in shards]
    open_files: Dict[int, object] = {}

    def finish(index: int) -> None:
        written = open_files.pop(index, None)
        path = os.path.join(save_dir, files[index])
        if safe:
            (written or SafetensorsWriter(path, [])).close()
        else:
            torch.save(written if written is not None else OrderedDict(), path)

    for entry in entries:
        if entry.buffer is None:
            name, tensor = next(tensors)
            if name != entry.name:
                raise RuntimeError(f"save_16bit_model: the stream gave {name!r} where the plan has {entry.name!r}")
        else:
            tensor = entry.buffer
        heap.streamed(entry.nbytes)  # [Note: the save's resident memory]
        if rank != 0:
            continue
        index = shard_of[id(entry)]
        if index not in open_files:
            shard = shards[index]
            open_files[index] = (SafetensorsWriter(os.path.join(save_dir, files[index]),
                                                   [(e.name, e.dtype, e.shape) for e in shard])
                                 if safe else OrderedDict())
        if safe:
            open_files[index].append(entry.name, tensor)
        else:
            open_files[index][entry.name] = tensor.detach().to("cpu", copy=True)
        left[index] -= 1
        if left[index] == 0:
            finish(index)
    if rank == 0:
        for index, shard in enumerate(shards):
            if not shard:
                finish(index)  # an empty model's one file
    for _ in tensors:  # the stream's end: nothing left, but every rank finishes it alike
        raise RuntimeError("save_16bit_model: the stream has tensors the plan does not")


def save_16bit_model(model_or_engine, save_dir, max_shard_size="5GB", safe_serialization: bool = True,
                     exclude_frozen_parameters: bool = False, merge_adapters: bool = False,
                     bucket_numel: Optional[int] = None) -> List[str]:
    """Write the full model of a ZeRO-3 engine (or its module) to ``save_dir`` in Hugging Face's layout, on
    every rank in lockstep as upstream's ``save_16bit_model`` is called ([Note: saving through the stream]).
    Tensors keep the model's dtype (16-bit for a bf16/fp16 model). ``merge_adapters=True`` on a peft LoRA model
    writes the merged base model, named as ``merge_and_unload()`` names it. Returns the file names written, on
    every rank."""
    from deepspeed_zero3.weights import iter_gathered_parameters, stream_module

    if not isinstance(save_dir, (str, os.PathLike)):
        raise ValueError(f"save_16bit_model: save_dir={save_dir!r} is not allowed: expected a directory path")
    save_dir = os.fspath(save_dir)
    max_bytes = parse_shard_size(max_shard_size)
    if merge_adapters and exclude_frozen_parameters:
        raise ValueError("save_16bit_model: merge_adapters=True merges the adapters into the frozen base weights, "
                         "so exclude_frozen_parameters=True would drop what it writes; pass one of them")
    module = stream_module(model_or_engine)
    names = None
    if exclude_frozen_parameters:
        names = [name for name, param in module.named_parameters() if param.requires_grad]
    stream = iter_gathered_parameters(module, bucket_numel=bucket_numel, names=names, merge_adapters=merge_adapters)
    entries = plan_entries(module, stream, exclude_frozen_parameters, merge_adapters)
    shards = plan_shards(entries, max_bytes)
    files, index = shard_files(len(shards), safe_serialization)
    rank, world = _rank_and_world()
    _agree_on_directory(save_dir, rank, world)

    tensors = iter(stream)
    try:
        heap = HeapTrim(min(max_bytes, TRIM_INTERVAL_CAP))
        _write_shards(tensors, entries, shards, files, save_dir, safe_serialization, rank, heap)
    except Exception as error:
        stream.note_error(error)  # the other ranks' error names it ([Note: a stream stops together])
        tensors.close()
        raise
    if rank == 0:
        if index is not None:
            weight_map = {e.name: file_name for shard, file_name in zip(shards, files) for e in shard}
            with open(os.path.join(save_dir, index), "w") as handle:
                json.dump({"metadata": {"total_size": sum(e.nbytes for e in entries)}, "weight_map": weight_map},
                          handle, indent=2)
                handle.write("\n")
        for name in _stale(save_dir, safe_serialization, files + ([index] if index else [])):
            os.remove(os.path.join(save_dir, name))
    return files + ([index] if index else [])


def consolidated_16bit_state_dict(model_or_engine, exclude_frozen_parameters: bool = False,
                                  bucket_numel: Optional[int] = None) -> Optional["OrderedDict[str, torch.Tensor]"]:
    """Upstream's ``engine._zero3_consolidated_16bit_state_dict()`` through the stream: on rank 0 the whole state
    dict on the CPU (a tied parameter under each of its names, one tensor), None on the other ranks. Call it on
    every rank. It holds the whole model in rank 0's memory, as upstream's does: prefer ``save_16bit_model``."""
    from deepspeed_zero3.weights import iter_gathered_parameters, stream_module

    module = stream_module(model_or_engine)
    names = [name for name, param in module.named_parameters() if param.requires_grad] \
        if exclude_frozen_parameters else None
    stream = iter_gathered_parameters(module, bucket_numel=bucket_numel, names=names)
    rank, _ = _rank_and_world()
    copies = {}
    for name, tensor in stream:
        if rank == 0:
            copies[name] = tensor.detach().to("cpu", copy=True)
    if rank != 0:
        return None
    first_name = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    state = OrderedDict()
    for prefix, sub in _state_dict_walk(module):
        for name, param in sub.named_parameters(recurse=False):
            if first_name[id(param)] in copies:
                state[prefix + name] = copies[first_name[id(param)]]
        for name, buf in sub.named_buffers(recurse=False):
            if buf is not None and name not in sub._non_persistent_buffers_set:
                state[prefix + name] = buf.detach().to("cpu", copy=True)
    return state


__all__ = ["save_16bit_model", "consolidated_16bit_state_dict", "parse_shard_size", "DTYPE_NAMES"]
