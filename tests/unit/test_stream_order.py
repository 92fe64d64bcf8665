"""[Note: the stream dependency] After every fetch the current stream waits for the all-gather stream.

A fake accelerator stands in for CUDA's streams and events only: it records which stream was current when a
gather was issued, when a handle was waited on, and every ``wait_stream``. The gathers themselves are fake
handles that complete their whole coalesced group at once, as upstream's ``AllGatherCoalescedHandle`` does.
"""

import contextlib

import pytest
import torch

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero import gather
from deepspeed_zero3.runtime.zero.gather import Gatherer, InflightParamRegistry
from deepspeed_zero3.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from zero_fakes import zmodule, zparam

AVAILABLE = ZeroParamStatus.AVAILABLE
NOT_AVAILABLE = ZeroParamStatus.NOT_AVAILABLE
INFLIGHT = ZeroParamStatus.INFLIGHT


class FakeStream:

    def __init__(self, name, log):
        self.name = name
        self.log = log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:

    def __init__(self, accelerator):
        self.accelerator = accelerator

    def record(self):
        self.accelerator.log.append(("record", self.accelerator.current.name))

    def query(self):
        return True

    def synchronize(self):
        self.accelerator.log.append(("synchronize", ))


class FakeAccelerator:
    """Streams and events that record their calls; everything else this runtime asks of an accelerator."""

    def __init__(self, resolves=False):
        self.log = []
        self.default = FakeStream("default", self.log)
        self.current = self.default
        self.resolves = resolves

    def new_stream(self, name):
        return FakeStream(name, self.log)

    @contextlib.contextmanager
    def stream(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def current_stream(self):
        return self.current

    def Event(self):
        return FakeEvent(self)

    def resolves_data_dependency(self):
        return self.resolves

    def handles_memory_backpressure(self):
        return False


class FakeHandle:
    """Completes every parameter of its coalesced group on the first wait, like upstream's handle."""

    def __init__(self, params, accelerator):
        self.params = params
        self.accelerator = accelerator
        self.complete = False

    def wait(self):
        self.accelerator.log.append(("handle_wait", self.accelerator.current.name, [p.ds_id for p in self.params]))
        if self.complete:
            return
        for param in self.params:
            param.ds_status = AVAILABLE
        self.complete = True


def gatherable(accelerator, ds_id, numel=4, persist=False):
    param = zparam(ds_id, numel, status=AVAILABLE if persist else NOT_AVAILABLE, persist=persist)
    param.ds_tensor = torch.zeros(1)
    param.ds_secondary_tensor = None
    param.ds_active_sub_modules = set()
    param.is_external_param = False

    def all_gather_coalesced(params, quantize=False):
        accelerator.log.append(("issue", accelerator.current.name, [p.ds_id for p in params]))
        for p in params:
            p.ds_status = INFLIGHT
        return FakeHandle(list(params), accelerator)

    def partition():
        param.ds_status = NOT_AVAILABLE

    param.all_gather_coalesced = all_gather_coalesced
    param.partition = partition
    return param


@pytest.fixture
def accelerator(monkeypatch):
    fake = FakeAccelerator()
    monkeypatch.setattr(gather, "get_accelerator", lambda: fake)
    return fake


def waits_after(log, start, stream_name):
    """The all-gather stream waits recorded since ``start`` for ``stream_name``, and whether the last one
    comes after every handle wait of that span."""
    span = log[start:]
    waits = [i for i, entry in enumerate(span) if entry == ("wait_stream", stream_name, "allgather")]
    handle_waits = [i for i, entry in enumerate(span) if entry[0] == "handle_wait"]
    return len(waits), bool(waits) and all(i < waits[-1] for i in handle_waits)


def test_wait_on_a_gather_in_flight_then_the_current_stream_waits(accelerator):
    ag = accelerator.new_stream("allgather")
    gatherer = Gatherer(ag, InflightParamRegistry())
    a = gatherable(accelerator, 0)
    gatherer.submit([a])
    gatherer.wait([a])
    assert accelerator.log == [("issue", "allgather", [0]), ("handle_wait", "allgather", [0]), ("record", "allgather"),
                               ("wait_stream", "default", "allgather")]


def test_a_coalesced_sibling_completed_under_another_stream(accelerator):
    """a and b in one gather; a's wait, under stream s1, completes b too. b's module then runs under s2:
    s2 must wait for the all-gather stream although b's gather was already complete."""
    ag, s1, s2 = (accelerator.new_stream(n) for n in ("allgather", "s1", "s2"))
    inflight = InflightParamRegistry()
    gatherer = Gatherer(ag, inflight)
    a, b = gatherable(accelerator, 0), gatherable(accelerator, 1)
    gatherer.submit([a, b])
    with accelerator.stream(s1):
        gatherer.wait([a])
    assert b.ds_status == AVAILABLE
    # Whether or not b is still registered (the release path unregisters completed siblings), s2 waits.
    for unregister in (False, True):
        if unregister:
            inflight.pop(b, None)
        start = len(accelerator.log)
        with accelerator.stream(s2):
            gatherer.wait([b])
        assert waits_after(accelerator.log, start, "s2") == (1, True)


def test_one_event_per_completed_gather(accelerator):
    """[Note: one event per completed gather]: a and b share one coalesced gather. Waiting for both records one
    event (upstream records two); a later wait for b, still registered, records none and still joins the
    streams."""
    ag = accelerator.new_stream("allgather")
    inflight = InflightParamRegistry()
    gatherer = Gatherer(ag, inflight)
    a, b, c = (gatherable(accelerator, i) for i in range(3))
    gatherer.submit([a, b])
    gatherer.wait([a, b])
    assert [entry[0] for entry in accelerator.log] == ["issue", "handle_wait", "record", "wait_stream"]
    gatherer.submit([c])
    gatherer.wait([c])
    a.ds_status = b.ds_status = NOT_AVAILABLE  # released
    gatherer.submit([a, b])
    gatherer.wait([a])
    start = len(accelerator.log)
    gatherer.wait([b])
    assert accelerator.log[start:] == [("wait_stream", "default", "allgather")]
    assert [entry[0] for entry in accelerator.log].count("record") == 3  # one per gather: {a, b}, {c}, {a, b}


@pytest.mark.parametrize("case", ["available", "persistent", "no_params"])
def test_nothing_in_flight_still_waits(accelerator, case):
    ag, s1 = accelerator.new_stream("allgather"), accelerator.new_stream("s1")
    gatherer = Gatherer(ag, InflightParamRegistry())
    params = {
        "available": [gatherable(accelerator, 0)],
        "persistent": [gatherable(accelerator, 0, persist=True)],
        "no_params": [],
    }[case]
    for param in params:
        param.ds_status = AVAILABLE  # completed earlier (reused, claimed, kept for the backward)
    with accelerator.stream(s1):
        gatherer.wait(params)
    assert accelerator.log == [("wait_stream", "s1", "allgather")]


def test_no_wait_where_the_accelerator_resolves_data_dependencies(monkeypatch):
    """Upstream's condition: accelerators that resolve data dependencies themselves get no wait_stream."""
    fake = FakeAccelerator(resolves=True)
    monkeypatch.setattr(gather, "get_accelerator", lambda: fake)
    gatherer = Gatherer(fake.new_stream("allgather"), InflightParamRegistry())
    a = gatherable(fake, 0)
    gatherer.submit([a])
    gatherer.wait([a])
    gatherer.wait([])
    assert not [entry for entry in fake.log if entry[0] == "wait_stream"]


def test_every_fetch_of_a_replayed_pass_waits_whatever_the_coalescing(accelerator):
    """Two forwards through the coordinator, each fetch under its own stream. The second replays the first's
    trace with prefetching (m1 and m2's parameters coalesced into one gather), a reuse distance that keeps
    m0's parameter for its second use, a module without parameters and a persistent parameter: many fetches
    pop no handle of their own. Every fetch ends with its stream waiting for the all-gather stream."""
    ag = accelerator.new_stream("allgather")
    streams = [accelerator.new_stream(f"s{i}") for i in range(3)]
    a, b, c, d = (gatherable(accelerator, i) for i in range(4))
    p = gatherable(accelerator, 4, persist=True)
    root = zmodule(100)
    m0, m1, m2, m3, empty = zmodule(10, a), zmodule(11, b), zmodule(12, c), zmodule(13, d, p), zmodule(14)
    order = [root, m0, m1, m2, empty, m0, m3]
    coordinator = PartitionedParameterCoordinator(prefetch_bucket_sz=8,
                                                  max_reuse_distance_in_numel=100,
                                                  max_available_parameters_in_numel=10**9,
                                                  allgather_stream=ag,
                                                  inflight_param_registry=InflightParamRegistry())
    missing = []
    for _ in range(2):
        with torch.no_grad():
            coordinator.enter_root_forward()
            for index, module in enumerate(order):
                stream = streams[index % len(streams)]
                start = len(accelerator.log)
                with accelerator.stream(stream):
                    coordinator.fetch_sub_module(module, forward=True)
                    waits, last = waits_after(accelerator.log, start, stream.name)
                    if not last:
                        missing.append((index, module.ds_id))
                    coordinator.release_sub_module(module, forward=True)
            coordinator.exit_root_forward(aborted=False)
    assert missing == []
    assert [record.trace_records for record in coordinator.stats.history] == [1, 0]
    # The first forward gathers on demand, m0's second use again. The replay coalesces a and b into one
    # gather (b's wait finds it complete) and keeps a for m0's second use (nothing to pop there).
    issued = [entry for entry in accelerator.log if entry[0] == "issue"]
    assert [ids for _, _, ids in issued] == [[0], [1], [2], [0], [3], [0, 1], [2], [3]]
