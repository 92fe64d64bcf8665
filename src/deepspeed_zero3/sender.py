"""``deepspeed_zero3.WeightSender`` and ``receive_weights``: a ZeRO-3 model's weights to another process, one call a
sync on each side.

    # every trainer rank                                  # the receiver (an inference process)
    sender = WeightSender(engine, group)                  receive_weights(group, model)   # once per sync
    sender.send()                                         # (or a dict name -> tensor)

``group`` is any torch process group in which trainer rank 0 is ``src`` (0 by default) and the receivers are the
other members: NCCL when the tensors are on a GPU, gloo on CPU, built from a TCP store as RL stacks build theirs.
Trainer ranks other than 0 pass ``group=None``: they take part in the stream's all-gathers only. A sync is the
metadata first (names, dtypes, shapes and the bucket each is in, one broadcast of its length and one of its JSON),
then each bucket of the weight stream as one flat buffer per dtype, the next bucket's all-gather in flight while
rank 0 broadcasts. If a broadcast fails on rank 0 (a receiver that died, or did not answer within the group's
timeout), rank 0 raises naming the group and the bucket, and every other trainer rank raises after that same
bucket ([Note: a stream stops together]): no rank hangs.
"""

import json
from typing import Dict, Optional, Union

import torch
import torch.distributed as dist
from torch.nn import Module


def _broadcast(group, tensor: torch.Tensor, src: int) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def _flat_by_dtype(names, tensors) -> Dict[str, torch.Tensor]:
    buffers: Dict[str, list] = {}
    for _name, tensor in zip(names, tensors):
        buffers.setdefault(str(tensor.dtype).removeprefix("torch."), []).append(tensor.reshape(-1))
    return {dtype: torch.cat(parts) for dtype, parts in sorted(buffers.items())}


class ReceiverFailed(RuntimeError):
    """A broadcast to the receivers failed on trainer rank 0 (a receiver died, or the group timed out)."""


class WeightSender:
    """One sync per ``send()``, on every trainer rank (see the module's docstring)."""

    def __init__(self, model_or_engine, group=None, src: int = 0, bucket_numel: Optional[int] = None):
        from deepspeed_zero3.weights import iter_gathered_parameters

        if group is not None and not hasattr(group, "broadcast"):
            raise TypeError(f"WeightSender: group={group!r} is not a process group (it has no broadcast); pass the "
                            f"group shared with the receivers on trainer rank 0, None on the other trainer ranks")
        if group is not None and not 0 <= src < group.size():
            raise ValueError(f"WeightSender: src={src} is not allowed: the group has {group.size()} members "
                             f"(0 to {group.size() - 1}); src is trainer rank 0's rank in it")
        self.group, self.src = group, src
        self._open = lambda: iter_gathered_parameters(model_or_engine, bucket_numel=bucket_numel)
        self._open()  # refuses bad input now; gathers nothing
        self.syncs = 0

    def send(self) -> None:
        stream = self._open()
        info = {**stream.vllm_update_info(), "groups": stream.groups()}  # before any gather
        with stream:
            for index, (names, tensors) in enumerate(stream.iter_groups()):
                if self.group is None:
                    continue
                if index == 0:  # sent inside the stream, so that a failure here stops the other ranks too
                    self._guarded("the metadata", lambda: _send_object(self.group, info, self.src), stream)
                flats = _flat_by_dtype(names, tensors)
                self._guarded(f"bucket {index} ({names[0]} ...)",
                              lambda: [_broadcast(self.group, flat, self.src) for flat in flats.values()],
                              stream)
        self.syncs += 1

    def _guarded(self, what: str, send, stream) -> None:
        try:
            send()
        except RuntimeError as error:
            failed = ReceiverFailed(f"WeightSender: sending {what} to the receivers failed on trainer rank 0 (a "
                                    f"receiver died or did not answer within the group's timeout): {error}")
            stream.note_error(failed)  # the other trainer ranks' error names it
            raise failed from error


def _send_object(group, value, src: int) -> None:
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    _broadcast(group, torch.tensor([payload.numel()], dtype=torch.int64), src)
    _broadcast(group, payload, src)


def _receive_object(group, src: int):
    length = torch.zeros(1, dtype=torch.int64)
    _broadcast(group, length, src)
    payload = torch.empty(int(length.item()), dtype=torch.uint8)
    _broadcast(group, payload, src)
    return json.loads(payload.numpy().tobytes().decode())


def receive_weights(group, into: Union[Module, Dict[str, torch.Tensor]], src: int = 0,
                    device: Optional[torch.device] = None) -> Dict[str, tuple]:
    """One sync on a receiver: the metadata, then every bucket, copied into ``into`` (a module's parameters by name,
    or a dict of tensors, each of the sent shape) as it arrives. Returns the metadata by name, ``(dtype name,
    shape)``. A name ``into`` lacks raises before any bucket is received, naming it."""
    targets = dict(into.named_parameters()) if isinstance(into, Module) else into
    info = _receive_object(group, src)
    meta = {name: (dtype, tuple(shape)) for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"])}
    missing = [name for name in meta if name not in targets]
    if missing:
        raise KeyError(f"receive_weights: {len(missing)} sent name(s) not in the receiver, first {missing[0]!r}")
    with torch.no_grad():
        for names in info["groups"]:
            by_dtype: Dict[str, list] = {}
            for name in names:
                by_dtype.setdefault(meta[name][0], []).append(name)
            for dtype in sorted(by_dtype):
                shapes = [meta[name][1] for name in by_dtype[dtype]]
                sizes = [int(torch.Size(shape).numel()) for shape in shapes]
                flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype), device=device)
                _broadcast(group, flat, src)
                for name, piece, shape in zip(by_dtype[dtype], flat.split(sizes), shapes):
                    targets[name].copy_(piece.view(shape))
    return meta
