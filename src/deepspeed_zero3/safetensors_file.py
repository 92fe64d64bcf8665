"""Writing one safetensors file tensor by tensor, the header first: no dependency, and no whole shard in memory.

The safetensors format: an unsigned little-endian 64-bit header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
padded with spaces to a multiple of 8 bytes, then the tensors' bytes, row-major and little-endian, in the
header's offsets. Every name, dtype and shape is known before any gather (``WeightStream.metadata()``), so the
offsets are too: the header is written first and each tensor is appended as it arrives.
"""

import json
import struct
import sys
from typing import Dict, List, Sequence, Tuple

import torch

DTYPE_NAMES: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count * torch.empty((), dtype=dtype).element_size()


class SafetensorsWriter:
    """``append`` each planned tensor in order, then ``close``; a tensor out of plan order is refused."""

    def __init__(self, path: str, entries: List[Tuple[str, torch.dtype, Tuple[int, ...]]]):
        if sys.byteorder != "little":
            raise RuntimeError("deepspeed-zero3 writes safetensors on little-endian machines only")
        header, offset = {}, 0
        for name, dtype, shape in entries:
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"safetensors cannot hold {name!r}: dtype {dtype} is not one of "
                                 f"{sorted(str(d) for d in DTYPE_NAMES)}")
            size = nbytes(dtype, shape)
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        header["__metadata__"] = {"format": "pt"}  # what transformers' from_pretrained checks for
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.expected = [(name, dtype, tuple(shape)) for name, dtype, shape in entries]
        self.index = 0
        self.staging = None  # one host buffer for device tensors, reused (grown to the largest): see ``append``
        self.handle = open(path, "wb")
        self.handle.write(struct.pack("<Q", len(text)))
        self.handle.write(text)

    def append(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.expected[self.index] if self.index < len(self.expected) else None
        if expected != (name, tensor.dtype, tuple(tensor.shape)):
            raise RuntimeError(f"safetensors writer: got {name!r} {tensor.dtype} {tuple(tensor.shape)}, the plan "
                               f"says {expected}")
        # Written from the tensor's own memory when it is on the host, else through one reused host buffer: no
        # allocation per tensor, whose freed blocks the C allocator would keep, growing the writer's resident memory
        # with the model's size.
        data = tensor.detach()
        if data.numel():
            raw = data.contiguous().reshape(-1).view(torch.uint8)
            if raw.device.type != "cpu":
                if self.staging is None or self.staging.numel() < raw.numel():
                    self.staging = torch.empty(raw.numel(), dtype=torch.uint8)
                staged = self.staging[:raw.numel()]
                staged.copy_(raw)
                raw = staged
            self.handle.write(memoryview(raw.numpy()))
        self.index += 1

    def close(self) -> None:
        self.handle.close()
        if self.index != len(self.expected):
            raise RuntimeError(f"safetensors writer: {len(self.expected) - self.index} planned tensor(s) never came")


def read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, by name, in the file's order (for checks; loaders have their own)."""
    by_name = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    with open(path, "rb") as handle:
        (length, ) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
        data = handle.read()
    header.pop("__metadata__", None)
    tensors = {}
    for name, spec in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
        begin, end = spec["data_offsets"]
        dtype = by_name[spec["dtype"]]
        raw = bytearray(data[begin:end])
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(spec["shape"])
    return tensors
