"""How much of the gathering (host-to-device copies, NCCL kernels) a profiler trace shows under compute.

Pure functions over a Chrome trace (``torch.profiler``'s ``export_chrome_trace``), so they are tested on
CPU. Device activities are the complete events ("ph": "X") of categories ``kernel`` and ``gpu_memcpy``;
a gathering activity is a NCCL kernel or a host-to-device copy, compute is every other kernel. The
fraction is the gathering time that lies under the union of compute intervals, over all gathering time.
"""

import json
from typing import Dict, Iterable, List, Tuple

Interval = Tuple[float, float]


def is_gathering(event: dict) -> bool:
    name = event.get("name", "")
    if event.get("cat") == "gpu_memcpy":
        return "HtoD" in name or "Host to Device" in name
    return event.get("cat") == "kernel" and "nccl" in name.lower()


def is_compute(event: dict) -> bool:
    return event.get("cat") == "kernel" and "nccl" not in event.get("name", "").lower()


def device_events(trace: dict) -> List[dict]:
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e]


def union(intervals: Iterable[Interval]) -> List[Interval]:
    merged: List[Interval] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def covered(interval: Interval, merged: List[Interval]) -> float:
    """Length of ``interval`` under the disjoint, sorted ``merged`` intervals."""
    start, end = interval
    total = 0.0
    for low, high in merged:
        if high <= start:
            continue
        if low >= end:
            break
        total += min(end, high) - max(start, low)
    return total


def overlap_of(trace) -> Dict[str, float]:
    """``gather_us``, ``overlapped_us``, ``compute_us`` and ``fraction`` (None without gathering) of a trace."""
    events = device_events(trace)
    gathering = [(e["ts"], e["ts"] + e["dur"]) for e in events if is_gathering(e)]
    compute = union((e["ts"], e["ts"] + e["dur"]) for e in events if is_compute(e))
    gather_us = sum(end - start for start, end in union(gathering))
    overlapped = sum(covered(interval, compute) for interval in union(gathering))
    return {
        "gather_us": round(gather_us, 1),
        "overlapped_us": round(overlapped, 1),
        "compute_us": round(sum(end - start for start, end in compute), 1),
        "fraction": round(overlapped / gather_us, 4) if gather_us else None,
    }


def overlap_of_file(path) -> Dict[str, float]:
    with open(path) as handle:
        return overlap_of(json.load(handle))
