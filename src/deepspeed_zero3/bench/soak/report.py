"""From the per-rank samples to the soak's verdict: slopes, flatness criteria and the table (plain Python).

Slopes are least-squares fits over the second half of the run (steps ``steps // 2`` to the end): the
first half holds the warm-up (first traces recorded, the allocator and the optimizer state reaching
their working size), which is growth by design, not a leak.

The flatness criteria (listed in ``worker.py``'s docstring) are the entries of ``criteria()``.
``--relaxed`` keeps the RSS and trace-record ones in the report without failing on them: a smoke run of
a few steps has no steady state to judge.
"""

import statistics
from typing import List, Optional

from deepspeed_zero3.bench.tables import markdown_table


def slope(xs: List[float], ys: List[float]) -> float:
    """Least-squares slope of ys against xs."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a slope needs at least 2 paired points, got {len(xs)} and {len(ys)}")
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mean_x)**2 for x in xs)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx


def summarize_rank(record: dict, cycle_len: int) -> dict:
    """One rank's numbers. ``record``: {"series": {name: [per step]}, "seconds": [...], "after_close": {...}}."""
    series = record["series"]
    steps = len(series["rss_kib"])
    half = steps // 2
    xs = list(range(half, steps))

    def fit(name):
        return slope(xs, series[name][half:])

    rss = series["rss_kib"]
    ms = [1000.0 * s for s in record["seconds"]]
    records = series["trace_records"]
    first_cycle = records[cycle_len - 1] if steps > cycle_len else None
    return {
        "steps": steps,
        "second_half": [half, steps - 1],
        "rss_slope_kib_per_step": fit("rss_kib"),
        "rss_growth_second_half_mib": (rss[-1] - rss[half]) / 1024,
        "rss_mib": {"first": rss[0] / 1024, "second_half_start": rss[half] / 1024, "last": rss[-1] / 1024},
        "malloc_slope_kib_per_step": None if series.get("malloc_kib") is None else fit("malloc_kib"),
        "py_blocks_slope_per_step": fit("py_blocks"),
        "py_blocks_growth_second_half": series["py_blocks"][-1] - series["py_blocks"][half],
        "live_numel_max": max(series["live_numel"]),
        "live_numel_nonzero_steps": sum(1 for v in series["live_numel"] if v),
        "zero_hooks_min": min(series["zero_hooks"]),
        "zero_hooks_max": max(series["zero_hooks"]),
        "zero_hooks_after_close": record["after_close"]["zero_hooks"],
        "module_hooks_first": series["module_hooks"][0],
        "module_hooks_last": series["module_hooks"][-1],
        "owners_min": min(series["owners"]),
        "owners_max": max(series["owners"]),
        "traces_cached_last": series["traces_cached"][-1],
        "trace_records_total": records[-1],
        "trace_records_first_cycle": first_cycle,
        "trace_records_after_first_cycle": None if first_cycle is None else records[-1] - first_cycle,
        "step_ms_median_first_half": statistics.median(ms[:half]),
        "step_ms_median_second_half": statistics.median(ms[half:]),
        "step_ms_slope_per_100_steps": 100 * slope(xs, ms[half:]),
    }


def criteria(ranks: List[dict], max_rss_slope: float, relaxed: bool) -> List[dict]:
    """Each criterion over every rank: name, passed (None: not measurable in this run), enforced, detail."""

    def per_rank(fmt):
        return "; ".join(f"rank {r}: {fmt(s)}" for r, s in enumerate(ranks))

    after_first = [s["trace_records_after_first_cycle"] for s in ranks]
    return [
        {"name": "live gathered numel is 0 at every step end", "enforced": True,
         "passed": all(s["live_numel_max"] == 0 for s in ranks),
         "detail": per_rank(lambda s: f"max {s['live_numel_max']:,}, nonzero at {s['live_numel_nonzero_steps']} steps")},
        {"name": "ZeRO hook count constant at step ends, 0 after destroy", "enforced": True,
         "passed": all(s["zero_hooks_min"] == s["zero_hooks_max"] and s["zero_hooks_after_close"] == 0 for s in ranks),
         "detail": per_rank(lambda s: f"{s['zero_hooks_min']}..{s['zero_hooks_max']}, "
                            f"{s['zero_hooks_after_close']} after destroy")},
        {"name": f"RSS slope over the second half < {max_rss_slope:g} KiB/step", "enforced": not relaxed,
         "passed": all(s["rss_slope_kib_per_step"] < max_rss_slope for s in ranks),
         "detail": per_rank(lambda s: f"{s['rss_slope_kib_per_step']:.3f} KiB/step")},
        {"name": "no trace recorded after the first cycle", "enforced": not relaxed,
         "passed": None if None in after_first else all(n == 0 for n in after_first),
         "detail": per_rank(lambda s: "run shorter than one cycle" if s["trace_records_after_first_cycle"] is None
                            else f"{s['trace_records_after_first_cycle']} after, {s['trace_records_first_cycle']} in it")},
    ]


def verdict(checks: List[dict]) -> bool:
    """False when an enforced criterion failed; one that could not be measured does not fail the run."""
    return all(c["passed"] is not False for c in checks if c["enforced"])


def build(per_rank: List[dict], meta: dict, cycle_len: int, max_rss_slope: float, relaxed: bool) -> dict:
    ranks = [summarize_rank(record, cycle_len) for record in per_rank]
    checks = criteria(ranks, max_rss_slope, relaxed)
    return {"meta": dict(meta, cycle_length=cycle_len), "passed": verdict(checks), "criteria": checks,
            "ranks": ranks, "per_rank": per_rank}


ROWS = (
    ("RSS slope over the second half, KiB/step", lambda s: f"{s['rss_slope_kib_per_step']:.3f}"),
    ("RSS growth over the second half, MiB", lambda s: f"{s['rss_growth_second_half_mib']:+.2f}"),
    ("RSS at first step / second-half start / last step, MiB",
     lambda s: "{first:.1f} / {second_half_start:.1f} / {last:.1f}".format(**s["rss_mib"])),
    ("malloc in use (glibc mallinfo2), slope over the second half, KiB/step",
     lambda s: "-" if s["malloc_slope_kib_per_step"] is None else f"{s['malloc_slope_kib_per_step']:.3f}"),
    ("Python allocated blocks, slope over the second half, per step", lambda s: f"{s['py_blocks_slope_per_step']:.2f}"),
    ("live gathered numel at step ends, max", lambda s: f"{s['live_numel_max']:,}"),
    ("ZeRO hooks at step ends, min / max", lambda s: f"{s['zero_hooks_min']} / {s['zero_hooks_max']}"),
    ("ZeRO hooks after every engine's destroy()", lambda s: f"{s['zero_hooks_after_close']}"),
    ("all hooks on the model's modules, first / last step", lambda s: f"{s['module_hooks_first']} / {s['module_hooks_last']}"),
    ("engines owning the shared state at step ends, min / max", lambda s: f"{s['owners_min']} / {s['owners_max']}"),
    ("trace records: first cycle / after it", lambda s: f"{_dash(s['trace_records_first_cycle'])} / "
     f"{_dash(s['trace_records_after_first_cycle'])}"),
    ("cached traces at the end", lambda s: f"{s['traces_cached_last']}"),
    ("median step time, first / second half, ms",
     lambda s: f"{s['step_ms_median_first_half']:.0f} / {s['step_ms_median_second_half']:.0f}"),
    ("step time slope over the second half, ms per 100 steps", lambda s: f"{s['step_ms_slope_per_100_steps']:+.1f}"),
)


def _dash(value: Optional[int]) -> str:
    return "-" if value is None else str(value)


def table(result: dict) -> str:
    """A Markdown table (rank per column) and one PASS/FAIL line per criterion."""
    meta, ranks = result["meta"], result["ranks"]
    half = ranks[0]["second_half"]
    lines = [
        f"**soak: {meta['steps']} steps, {meta['model']}, {meta['world']} ranks ({meta['backend']}), cycle of "
        f"{meta['cycle_length']} steps; second half = steps {half[0] + 1}-{half[1] + 1}**",
        "",
        markdown_table(["", *(f"rank {r}" for r in range(len(ranks)))],
                       [[label, *(fmt(s) for s in ranks)] for label, fmt in ROWS]),
        "",
    ]
    for check in result["criteria"]:
        mark = {True: "PASS", False: "FAIL", None: "n/a "}[check["passed"]]
        if check["passed"] is False and not check["enforced"]:
            mark = "fail (relaxed)"
        lines.append(f"{mark} {check['name']}: {check['detail']}")
    lines.append("soak " + ("passed" if result["passed"] else "FAILED"))
    return "\n".join(lines)
