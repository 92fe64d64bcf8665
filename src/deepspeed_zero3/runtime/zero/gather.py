"""Issuing and completing all-gathers of partitioned parameters.

[Note: the fast path]
Gathers go through upstream's ``all_gather_coalesced`` on the dedicated
all-gather stream, exactly as upstream's coordinator issues them: parameters
with a secondary (hpZ) partition and those without are gathered in separate
calls, quantized partitions (ZeRO++ qwZ) with ``quantize=True``. Waiting for a
handle keeps upstream's back-pressure: at most two fetch events are left
queued on the stream, since memory is allocated by the host at submit time but
used later by the stream. On CPU (gloo) the stream is None and all of this runs
synchronously.

[Note: the stream dependency]
Whatever a wait popped, the current stream then waits for the all-gather stream,
as upstream's fetch_sub_module does after every fetch (on accelerators that do
not resolve data dependencies themselves). A parameter may have been completed
earlier while another stream was current: by a coalesced sibling's wait, or kept
for reuse, claimed by the prefetcher, kept for the backward. The stream running
this module has not waited for that copy yet, and would read ``param.data``
before the gather has written it.

[Note: one event per completed gather]
A coalesced handle completes all its parameters at its first wait; that wait
recorded the event that back-pressure counts. Upstream records one more per
parameter of it, which fills the bounded queue with gathers already counted, so
the host synchronizes sooner than MAX_QUEUED_FETCH_EVENTS gathers deep. Ours
records none for a handle already complete.
"""

import collections
import contextlib
from typing import Deque, Iterable, List

from torch.nn import Parameter

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.partition_parameters import AllGatherCoalescedHandle, ZeroParamStatus


MAX_QUEUED_FETCH_EVENTS = 2

_NO_TIMING = contextlib.nullcontext()


class InflightParamRegistry(dict):
    """Parameter -> all-gather handle, for parameters whose gather was issued and not yet waited on.

    A ``dict`` (upstream's is a ``UserDict``): lookups and ``pop(param, None)`` run once per parameter on every
    fetch and release, and ``UserDict.pop`` of a missing key raises and catches a ``KeyError`` inside. Every
    way of adding an entry goes through ``__setitem__``'s checks; ``data`` is kept for code written against
    upstream's ``UserDict``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, param: Parameter, handle) -> None:
        if param in self:
            raise RuntimeError(f"parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} is already in flight")
        if param.ds_status != ZeroParamStatus.INFLIGHT:
            raise RuntimeError(f"only an in-flight parameter can be registered, got ds_id={param.ds_id} "
                               f"with status {param.ds_status.name}")
        super().__setitem__(param, handle)

    def update(self, *args, **kwargs) -> None:
        for param, handle in dict(*args, **kwargs).items():
            self[param] = handle

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, param: Parameter, handle=None):
        if param not in self:
            self[param] = handle
        return super().__getitem__(param)

    def copy(self) -> "InflightParamRegistry":
        duplicate = InflightParamRegistry()
        dict.update(duplicate, self)
        return duplicate

    @property
    def data(self) -> dict:
        return self


def expect_status(params: Iterable[Parameter], status: ZeroParamStatus, after: str, *details) -> None:
    """Raise, naming the first of ``params`` whose status is not ``status`` and what it came ``after`` (formatted
    with ``details`` only then, so a check that passes builds no message)."""
    for param in params:
        if param.ds_status != status:
            raise RuntimeError(f"deepspeed-zero3: parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} is "
                               f"{param.ds_status.name} after {after.format(*details)}; expected {status.name}")


class Gatherer:
    """Issues gathers on the all-gather stream and completes them with back-pressure."""

    def __init__(self, allgather_stream, inflight: InflightParamRegistry, quantize_weights: bool = False):
        self.allgather_stream = allgather_stream
        self.inflight = inflight
        self.quantize_weights = quantize_weights
        self.queued_events: Deque = collections.deque()

    def submit(self, params: Iterable[Parameter], timed=None, before=None) -> List[List[Parameter]]:
        """Start gathering every NOT_AVAILABLE parameter of ``params``; returns the groups, one per collective.
        ``before()``, if given, is called once before the first collective, only if there is one.

        Groups, in this order: quantized with a secondary partition, quantized without, plain with, plain
        without; within a group, the order of ``params``. ``timed(group)``, if given, is a context manager
        around each group's collective ([Note: upstream's event timings]).
        """
        pending = [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        if not pending:
            return []  # the common case: everything was prefetched
        if before is not None:
            before()
        groups = ([], [], [], [])
        for param in pending:
            groups[(0 if hasattr(param.ds_tensor, "ds_quant_scale") else 2) +
                   (0 if param.ds_secondary_tensor is not None else 1)].append(param)
        issued = []
        for index, subgroup in enumerate(groups):
            if not subgroup:
                continue
            quantize = True if index < 2 else self.quantize_weights
            with get_accelerator().stream(self.allgather_stream), (timed(subgroup) if timed else _NO_TIMING):
                handle = subgroup[0].all_gather_coalesced(subgroup, quantize=quantize)
            for param in subgroup:
                self.inflight[param] = handle
            issued.append(subgroup)
        return issued

    def wait(self, params: Iterable[Parameter], fast_leaf: bool = False) -> None:
        """Block until each of ``params`` is AVAILABLE (those in flight are completed here), then make the
        current stream wait for the all-gather stream ([Note: the stream dependency]).

        ``fast_leaf``: upstream's wait for a z3 leaf under ``fast_sharding_for_leaf_module`` ([Note: fast
        sharding for leaf modules]): the gathered memory takes no compute-stream dependency, no back-pressure
        event is recorded, the stream waits only if a handle was popped, and the partitions are dropped at
        the end.
        """
        accelerator = get_accelerator()
        popped = False
        for param in params:
            handle = self.inflight.pop(param, None)
            if handle is None:
                continue
            popped = True
            if getattr(handle, "complete", False):
                continue  # [Note: one event per completed gather]
            with accelerator.stream(self.allgather_stream):
                while self.queued_events and self.queued_events[0].query():
                    self.queued_events.popleft()
                if len(self.queued_events) > MAX_QUEUED_FETCH_EVENTS:
                    self.queued_events.popleft().synchronize()
                if fast_leaf:
                    handle.wait(handle_dependency=False)
                    continue
                handle.wait()
                if not accelerator.handles_memory_backpressure():
                    event = accelerator.Event()
                    event.record()
                    self.queued_events.append(event)
        if (popped or not fast_leaf) and not accelerator.resolves_data_dependency():
            accelerator.current_stream().wait_stream(self.allgather_stream)
        if fast_leaf:
            AllGatherCoalescedHandle.free_buffer()

    def wait_all(self) -> List[Parameter]:
        """Complete every gather in flight; returns the parameters that were in flight."""
        params = list(self.inflight.keys())
        for param in params:
            self.inflight.pop(param).wait()
        return params
