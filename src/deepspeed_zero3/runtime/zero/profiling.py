"""Labelled ``torch.profiler`` ranges around fetch, prefetch issue, wait and release.

[Note: profiler ranges]
Under a running ``torch.profiler.profile`` (or the legacy autograd profiler, ``emit_nvtx``, ...) every
fetch, prefetch issue, wait and release of a module shows as a ``record_function`` range named
``ZeRO3::<what> <module class> ds_id=<id>``, as FSDP2 labels its all-gathers, so a Chrome trace of a step
shows which module's parameters the host was busy with and where it waited. With no profiler running
the range is one shared ``nullcontext``: the label string is never built and nothing is recorded; the
only cost is one C call (``torch._C._autograd._profiler_enabled``, ~40 ns) per range. These run inside
the compile-disabled hooks: nothing here is meant to be traced by Dynamo.
"""

import contextlib

import torch

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

_NO_RANGE = contextlib.nullcontext()
_profiler_enabled = torch._C._autograd._profiler_enabled


def module_range(what: str, module, suffix: str = "", params=None):
    """A profiler range ``ZeRO3::<what> <class> ds_id=<id><suffix>`` while a profiler runs, else a no-op.

    ``suffix`` is a constant (nothing is formatted when no profiler runs); ``params``, when given, adds
    their count and numel to the label.
    """
    if not _profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(f"ZeRO3::{what} {type(module).__name__} ds_id={module.ds_id}{suffix}"
                                          f"{_sizes(params)}")


def pass_range(what: str, suffix: str = "", params=None):
    """A range that names no module (the prefetch that primes a backward pass)."""
    if not _profiler_enabled():
        return _NO_RANGE
    return torch.profiler.record_function(f"ZeRO3::{what}{suffix}{_sizes(params)}")


def _sizes(params) -> str:
    if params is None:
        return ""
    return f" ({len(params)} params, {sum(p.ds_numel for p in params)} numel)"


class EventTimings:
    """Upstream's profiler events, timed around our own fetch submit, wait, prefetch submit and all-gather.

    [Note: upstream's event timings]
    ``partitioned_param_coordinator.ENABLE_PROFILER = True`` (read when a coordinator is built, as upstream
    reads it) gives each coordinator one of these over upstream's ``PartitionedParameterProfiler`` and the
    engine's timers, with upstream's event names (``forward_fetch_submit``, ...). The counters add up from
    one root forward to the next, and are logged and reset when the next forward begins if the passes
    since replayed a trace, as upstream logs at its ``reset_step``. What differs is what the events cover:
    ours count our collectives (one all-gather event per coalesced group) and our demand fetches, which a
    replayed trace's prefetch mostly avoids.
    """

    def __init__(self, profiler):
        self.profiler = profiler
        self.due = False  # a pass replaying a trace ended since the last log

    def around(self, name: str, params, what: str, inflight):
        """The event ``name`` around a fetch submit (``what="fetch"``), wait (``"wait"``) or prefetch submit of
        ``params``, with the numel upstream records for it; a fetch that gathers nothing records none, as
        upstream's. ``inflight``: the in-flight registry, read before the wait."""
        if what == "fetch":
            numel = sum(p.partition_numel() for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
            if numel == 0:
                return _NO_RANGE
        elif what == "wait":
            numel = sum(p.partition_numel() for p in params if p in inflight)
        else:
            numel = sum(p.ds_numel for p in params)
        return self.event(name, numel)

    @contextlib.contextmanager
    def event(self, name: str, numel: int):
        self.profiler.start_event(name)
        try:
            yield
        finally:
            self.profiler.stop_event(name, numel)

    def pass_ended(self, replayed: bool) -> None:
        self.due = self.due or replayed

    def forward_began(self) -> None:
        if self.due:
            self.profiler.log_events()
        self.profiler.reset_events()
        self.due = False
