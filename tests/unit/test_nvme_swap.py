"""The NVMe read-ahead policy ([Note: NVMe swap-in ahead]) against a swapper that only counts buffers.

The real swapper needs the async_io op and files; its buffer accounting is all the policy reads, so a stand-in
that keeps that accounting tests the policy on any machine. tests/parity runs the real one.
"""

from types import SimpleNamespace

from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.nvme_swap import NvmeSwapIns, blocks_gather


class CountingSwapper:

    def __init__(self, buffers):
        self.free = buffers
        self.reads = []
        self.given_back = []

    def available_swap_in_buffers(self):
        return self.free

    def swap_in(self, params, async_op=True):
        assert len(params) <= self.free, "the swapper asserts a free buffer per read"
        self.free -= len(params)
        self.reads.append([p.ds_id for p in params])
        for p in params:
            p.ds_tensor.status = PartitionedParamStatus.INFLIGHT

    def synchronize_reads(self):
        pass

    def remove_partition_and_release_buffers(self, params):
        for p in params:
            self.free += 1
            self.given_back.append(p.ds_id)
            p.ds_tensor.status = PartitionedParamStatus.NOT_AVAILABLE


class FakeParam(SimpleNamespace):
    __hash__ = object.__hash__  # identity, as torch parameters hash
    __eq__ = object.__eq__


def nvme_param(ds_id, swapper, numel=100):
    tensor = SimpleNamespace(final_location=OffloadDeviceEnum.nvme, status=PartitionedParamStatus.NOT_AVAILABLE)
    return FakeParam(ds_id=ds_id, ds_numel=numel, ds_status=ZeroParamStatus.NOT_AVAILABLE, ds_tensor=tensor,
                           nvme_swapper=swapper)


def uses_of(params):
    return [(p, step) for step, p in enumerate(params)]


def test_read_ahead_stays_within_free_buffers_and_the_lookahead():
    swapper = CountingSwapper(buffers=3)
    params = [nvme_param(i, swapper) for i in range(6)]
    swaps = NvmeSwapIns()
    assert swaps.read_ahead(uses_of(params), start=1, lookahead_numel=10_000) == 3
    assert swapper.reads == [[1, 2, 3]] and swapper.free == 0
    assert not blocks_gather(params[1]) and blocks_gather(params[4])
    assert swaps.read_ahead(uses_of(params), start=4, lookahead_numel=10_000) == 0  # no buffer: no read
    swapper2 = CountingSwapper(buffers=5)
    more = [nvme_param(i, swapper2) for i in range(6)]
    assert NvmeSwapIns().read_ahead(uses_of(more), start=0, lookahead_numel=200) == 2  # one bucket of numel


def test_unused_reads_are_given_back_at_pass_end():
    swapper = CountingSwapper(buffers=4)
    params = [nvme_param(i, swapper) for i in range(4)]
    swaps = NvmeSwapIns()
    swaps.read_ahead(uses_of(params), start=0, lookahead_numel=10_000)
    params[0].ds_status = ZeroParamStatus.AVAILABLE  # gathered: its own partition() gives its buffer back
    assert swaps.end_pass() == 3
    assert swapper.given_back == [1, 2, 3] and swapper.free == 3 and not swaps.ahead


def test_a_demand_fetch_frees_stale_reads_first_then_gathered_parameters():
    swapper = CountingSwapper(buffers=2)
    params = [nvme_param(i, swapper) for i in range(5)]
    swaps = NvmeSwapIns()
    swaps.read_ahead(uses_of(params), start=0, lookahead_numel=10_000)  # reads 0 and 1: no buffer left
    released = []
    swaps.make_room([params[3]], release_unused_gathered=released.append)
    assert swapper.free == 1 and swapper.given_back == [1] and released == []  # the latest stale read went first
    swaps.make_room([params[3], params[4]], release_unused_gathered=released.append)
    assert swapper.free == 2 and swapper.given_back == [1, 0] and released == []
    swaps.make_room([params[2], params[3], params[4]], release_unused_gathered=released.append)
    assert released == [1]  # nothing stale left: one gathered parameter not in use must go
