"""Swapping NVMe-offloaded partitions into memory ahead of their gather.

[Note: NVMe swap-in ahead]
With ``offload_param.device: nvme`` a partition lives in a file; upstream's swapper reads it
into one of ``offload_param.buffer_count`` buffers before the gather copies it. A gather of a
partition still on NVMe reads it synchronously and asserts a free buffer. The rules:
* the gather walk stops at a partition not in memory yet (``blocks_gather``), so a prefetch
  never reads synchronously nor takes a buffer nobody planned for;
* after each fetch the next partitions of the same pass's trace are read ahead, asynchronously,
  within the free buffers and one prefetch bucket of numel;
* reads belong to a pass: one not gathered by its end gives its buffer back, so no buffer
  outlives its pass and no read taken before an optimizer step is used after it. A demand fetch
  that finds too few free buffers gives back stale reads first, then gathered parameters not in
  use: at worst a second gather, never a deadlock nor the swapper's assertion.
"""

from typing import Callable, Dict, Iterable, List, Sequence, Tuple

from torch.nn import Parameter

from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.residency import releasable


def on_nvme(param: Parameter) -> bool:
    """The partition's home is an NVMe file (small partitions of an NVMe-offloaded model stay in memory)."""
    return getattr(param, "nvme_swapper", None) is not None and param.ds_tensor.final_location == OffloadDeviceEnum.nvme


def not_in_memory(param: Parameter) -> bool:
    return on_nvme(param) and param.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE


def blocks_gather(param: Parameter) -> bool:
    """The gather walk must stop here: gathering now would read the partition synchronously."""
    return param.ds_status == ZeroParamStatus.NOT_AVAILABLE and not_in_memory(param)


class NvmeSwapIns:
    """One pass's reads ahead of its gather walk: it gives back what the pass read and did not use. Each pass holds
    its own ([Note: the running pass]), so no read outlives its pass."""

    def __init__(self):
        # Partitions this pass read ahead (an ordered set).
        self.ahead: Dict[Parameter, None] = {}

    def read_ahead(self, uses: Sequence[Tuple[Parameter, int]], start: int, lookahead_numel: int) -> int:
        """Start reading the partitions of ``uses[start:]`` still on NVMe; returns how many reads were issued."""
        chosen: Dict[Parameter, None] = {}  # an ordered set (a list would compare tensors by value)
        considered = 0
        swapper = None
        for param, _ in uses[start:]:
            if considered >= lookahead_numel:
                break
            if not on_nvme(param) or param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                continue
            swapper = param.nvme_swapper
            if param.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE and param not in chosen:
                if len(chosen) >= swapper.available_swap_in_buffers():
                    break
                chosen[param] = None
            considered += param.ds_numel
        if chosen:
            swapper.swap_in(list(chosen), async_op=True)
            for param in chosen:
                self.ahead[param] = None
        return len(chosen)

    def give_back(self, params: Iterable[Parameter]) -> int:
        """Return the buffers of partitions read ahead but not gathered; returns how many."""
        released = 0
        for param in list(params):
            self.ahead.pop(param, None)
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE or param.ds_tensor.status == PartitionedParamStatus.NOT_AVAILABLE:
                continue  # gathered (its partition() gives the buffer back), or never read
            if param.ds_tensor.status == PartitionedParamStatus.INFLIGHT:
                param.nvme_swapper.synchronize_reads()
            param.nvme_swapper.remove_partition_and_release_buffers([param])
            released += 1
        return released

    def end_pass(self) -> int:
        """The pass is over: give back every read it did not use."""
        return self.give_back(list(self.ahead))

    def make_room(self, needed: Sequence[Parameter], release_unused_gathered: Callable[[int], None]) -> None:
        """Before a demand fetch that reads ``needed`` synchronously: free that many buffers if they are not."""
        if not needed:
            return
        swapper = needed[0].nvme_swapper
        missing = len(needed) - swapper.available_swap_in_buffers()
        if missing <= 0:
            return
        needed_ids = {id(p) for p in needed}
        stale = [p for p in self.ahead if id(p) not in needed_ids]
        self.give_back(stale[-missing:] if missing < len(stale) else stale)
        missing = len(needed) - swapper.available_swap_in_buffers()
        if missing > 0:
            release_unused_gathered(missing)


def persistent_partitions_in_memory(params: Iterable[Parameter]) -> List[Parameter]:
    """Persistent parameters whose NVMe partition is in a buffer: once gathered they never need it again."""
    return [p for p in params if p.ds_persist and on_nvme(p) and p.ds_tensor.status != PartitionedParamStatus.NOT_AVAILABLE]


def release_gathered_on_nvme(candidates: Iterable[Parameter], count: int, release: Callable[[Parameter], None]) -> None:
    """Free up to ``count`` swap buffers: ``release`` the first ``candidates`` whose partition is on NVMe, gathered
    and releasable (no module uses it, no ``GatheredParameters`` holds it)."""
    for param in candidates:
        if count <= 0:
            return
        if on_nvme(param) and param.ds_status != ZeroParamStatus.NOT_AVAILABLE and releasable(param):
            release(param)
            count -= 1


def free_persistent_buffers(params: Iterable[Parameter]) -> None:
    """After a fetch: persistent parameters are gathered for good, so their partitions' buffers go back."""
    persisted = persistent_partitions_in_memory(params)
    if persisted:
        persisted[0].nvme_swapper.remove_partition_and_release_buffers(persisted)
