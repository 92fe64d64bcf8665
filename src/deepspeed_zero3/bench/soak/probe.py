"""The state the soak samples at the end of every step, read without changing it.

Nothing here calls ``gc.collect()``: a training job does not collect after every step, and forcing it
would hide a leak that only the automatic collector (or nothing) would free.
"""

import ctypes
import sys
from array import array

import deepspeed_zero3
from deepspeed_zero3.runtime.zero.param_registry import find_registry

SERIES = ("live_numel", "zero_hooks", "module_hooks", "owners", "traces_cached", "trace_records", "rss_kib",
          "malloc_kib", "py_blocks")


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        function = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    function.restype = MallInfo2
    return function


MALLINFO2 = _mallinfo2()


def rss_kib() -> int:
    """Resident set size of this process now (not the peak that ``resource`` reports)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import psutil  # not Linux: psutil reads the same number
    return psutil.Process().memory_info().rss // 1024


def malloc_kib():
    """Bytes malloc has handed out and not got back (glibc's mallinfo2: heap in use + mmapped chunks), or None.

    RSS also counts what the allocator keeps after a free (fragmentation, its top pad); this does not, so
    a live-allocation leak and allocator high-water growth can be told apart.
    """
    if MALLINFO2 is None:
        return None
    info = MALLINFO2()
    return (info.uordblks + info.hblkhd) // 1024


def module_hooks(model) -> int:
    """Every forward and backward hook on the model's modules, whoever installed it (not only ZeRO's)."""
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules())


class Probe:
    """Reads one sample per step into storage allocated up front, so the soak's own bookkeeping adds
    nothing per step to the RSS it measures."""

    def __init__(self, model, engine, steps: int):
        self.model = model
        self.engine = engine
        self.series = {name: array("q", [0]) * steps for name in SERIES}

    def read(self) -> dict:
        registry = find_registry(self.model)
        stats = deepspeed_zero3.get_zero3_stats(self.engine)
        malloc = malloc_kib()
        return {
            "live_numel": stats["live_numel"],
            "zero_hooks": registry.hook_count(),
            "module_hooks": module_hooks(self.model),
            "owners": len(registry.live_owners()),
            "traces_cached": len(registry.coordinator.traces),
            "trace_records": sum(totals["trace_records"] for totals in stats["totals"].values()),
            "rss_kib": rss_kib(),
            "malloc_kib": -1 if malloc is None else malloc,
            # pymalloc blocks in use, CPython's free lists included (only a full collection empties them):
            # a trend to look at next to the RSS, not an exact count of live objects.
            "py_blocks": sys.getallocatedblocks(),
        }

    def sample(self, step: int) -> dict:
        values = self.read()
        for name, value in values.items():
            self.series[name][step] = value
        return values

    def as_lists(self) -> dict:
        lists = {name: values.tolist() for name, values in self.series.items()}
        if lists["malloc_kib"] and lists["malloc_kib"][0] < 0:
            lists["malloc_kib"] = None  # not glibc
        return lists
