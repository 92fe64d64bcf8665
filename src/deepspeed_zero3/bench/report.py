"""From the two workers' raw JSON to one summary per scenario, and its tables (plain text and Markdown).

Every number is taken over the measured (steady-state) cycles of a scenario, the cycles after its warm-up:

* peak live gathered numel: maximum over every phase of those cycles, as % of the model;
* gathered numel per pass: all-gather output numel of a phase divided by the number of passes of that
  kind (a generation cycle has 16 eval forwards), as a multiple of the model;
* demand-fetched numel: per cycle (mean), all phases together;
* trace re-records: traces recorded during the measured cycles (``trace_records_after_first`` in the
  JSON counts from the second cycle on, warm-up included);
* step time: median wall time of a measured cycle (between barriers), and the median CPU time rank 0's
  process spent in one (on a shared machine other load stretches the wall time, much less the CPU time).
* host time per module: time rank 0 spent inside the coordinator's ``fetch_sub_module`` and
  ``release_sub_module`` over the measured cycles, divided by the number of fetches (one fetch and one
  release per module run): wall time and the thread's CPU time.

A scenario that crashed keeps the cycles it completed; with none measured its numbers are missing ("-").
"""

import statistics
from typing import Dict, List, Optional

from deepspeed_zero3.bench import RUNTIMES, tables

PASS_KINDS = ("forward", "backward", "eval_forward")

# (key, label, kind): kind picks the formatting and whether a ratio makes sense.
ROWS = (
    ("peak_live_pct", "peak live gathered, % of model", "pct"),
    ("forward_x", "gathered per forward pass, x model", "x"),
    ("backward_x", "gathered per backward pass, x model", "x"),
    ("eval_forward_x", "gathered per eval forward, x model", "x"),
    ("demand_per_cycle", "demand-fetched numel per cycle", "int"),
    ("trace_records", "trace re-records (measured cycles)", "int"),
    ("step_ms", "median step time, ms", "ms"),
    ("step_cpu_ms", "median step CPU time, rank 0, ms", "ms"),
    ("host_us_per_module", "host time per module fetch + release, us", "us"),
    ("host_cpu_us_per_module", "host CPU time per module fetch + release, us", "us"),
    ("status", "status", "status"),
)


def summarize_scenario(record: Optional[dict]) -> dict:
    """The table's numbers for one runtime's run of one scenario."""
    if record is None:
        return {"status": "missing"}
    summary = {"status": record.get("status", "missing"), "error": record.get("error")}
    cycles = record.get("cycles", [])
    measured = [c for c in cycles if c["measured"]]
    numel = record.get("numel")
    summary.update(numel=numel, label=record.get("label"), measured_cycles=len(measured),
                   trace_records_after_first=sum(c["trace_records"] for c in cycles[1:]) if cycles else None)
    if not measured or not numel:
        return summary
    peak = max((p["peak_live_numel"] for c in measured for p in c["phases"].values()), default=0)
    summary["peak_live_numel"] = peak
    summary["peak_live_pct"] = 100.0 * peak / numel
    for kind in PASS_KINDS:
        passes = sum(c["passes"].get(kind, 0) for c in measured)
        gathered = sum(c["phases"].get(kind, {}).get("allgather_numel", 0) for c in measured)
        summary[f"{kind}_passes"] = passes
        summary[f"{kind}_numel_per_pass"] = gathered / passes if passes else None
        summary[f"{kind}_x"] = gathered / passes / numel if passes else None
    summary["demand_per_cycle"] = sum(p["demand_numel"] for c in measured
                                      for p in c["phases"].values()) / len(measured)
    summary["trace_records"] = sum(c["trace_records"] for c in measured)
    summary["step_ms"] = 1000.0 * statistics.median(c["seconds"] for c in measured)
    summary["step_cpu_ms"] = 1000.0 * statistics.median(c.get("cpu_seconds", 0.0) for c in measured)
    fetches = sum((c.get("host") or {}).get("fetch_calls", 0) for c in measured)
    if fetches:
        summary["host_fetches_per_cycle"] = fetches / len(measured)
        for key, field in (("host_us_per_module", "seconds"), ("host_cpu_us_per_module", "cpu_seconds")):
            summary[key] = 1e6 * sum(c["host"][field] for c in measured) / fetches
    return summary


def ratio(upstream, ours) -> Optional[float]:
    if not isinstance(upstream, (int, float)) or not isinstance(ours, (int, float)):
        return None
    if upstream == 0:
        return None
    return ours / upstream


def summarize(raw: Dict[str, dict], scenarios: List[str]) -> Dict[str, dict]:
    """``raw``: runtime -> the worker's JSON (or None when its launch failed)."""
    summary = {}
    for name in scenarios:
        per_runtime = {rt: summarize_scenario(((raw.get(rt) or {}).get("scenarios") or {}).get(name))
                       for rt in RUNTIMES}
        summary[name] = {
            **per_runtime,
            "ratio": {key: ratio(per_runtime["upstream"].get(key), per_runtime["ours"].get(key))
                      for key, _, kind in ROWS if kind != "status"},
        }
    return summary


def _cell(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{value:.1f}%"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "int":
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"
    if kind in ("ms", "us"):
        return f"{value:.1f}"
    return str(value)


def _status(entry: dict) -> str:
    if entry.get("status") in ("ok", None):
        return entry.get("status") or "-"
    return f"{entry['status']}: {entry['error']}" if entry.get("error") else entry["status"]


def rows(entry: dict):
    """(label, upstream, ours, ratio) strings for one scenario."""
    for key, label, kind in ROWS:
        if kind == "status":
            yield label, entry["upstream"].get("status", "-"), entry["ours"].get("status", "-"), ""
            continue
        r = entry["ratio"].get(key)
        yield (label, _cell(entry["upstream"].get(key), kind), _cell(entry["ours"].get(key), kind),
               "-" if r is None else f"{r:.2f}")


def heading(name: str, entry: dict, meta: dict) -> str:
    info = entry["ours"] if entry["ours"].get("label") else entry["upstream"]
    numel = f"{info['numel']:,} params" if info.get("numel") else "? params"
    measured = max(entry["upstream"].get("measured_cycles", 0), entry["ours"].get("measured_cycles", 0))
    return (f"{name}: {info.get('label') or '?'} ({numel}), {meta.get('world')} ranks, "
            f"bucket {meta.get('bucket'):,}, reuse {meta.get('reuse')}, {measured} measured cycles")


def _crash_notes(entry: dict) -> List[str]:
    return [f"  {rt} {entry[rt]['status']}: {entry[rt]['error']}" for rt in RUNTIMES
            if entry[rt].get("status") not in ("ok", None) and entry[rt].get("error")]


def text_table(summary: Dict[str, dict], meta: dict) -> str:
    out = []
    for name, entry in summary.items():
        out.append(heading(name, entry, meta))
        out.append(tables.text_table(("", "upstream", "ours", "ours/upstream"), list(rows(entry))))
        out.extend(_crash_notes(entry))
        out.append("")
    return "\n".join(out)


def _pair(entry: dict, key: str, kind: str) -> str:
    return f"{_cell(entry['upstream'].get(key), kind)} / {_cell(entry['ours'].get(key), kind)}"


def _training_step_x(side: dict):
    forward, backward = side.get("forward_x"), side.get("backward_x")
    return None if forward is None or backward is None else forward + backward


def markdown_overview(summary: Dict[str, dict]) -> str:
    """One line per scenario, upstream / ours: the numbers that differ most."""
    body = []
    for name, entry in summary.items():
        step = {rt: _training_step_x(entry[rt]) for rt in RUNTIMES}
        times = ", ".join("-" if entry["ratio"].get(k) is None else f"{entry['ratio'][k]:.2f}"
                          for k in ("step_ms", "step_cpu_ms"))
        gathered = f"{_cell(step['upstream'], 'x')} / {_cell(step['ours'], 'x')}"
        status = f"{entry['upstream'].get('status', '-')} / {entry['ours'].get('status', '-')}"
        body.append((name, _pair(entry, "peak_live_pct", "pct"), gathered, _pair(entry, "demand_per_cycle", "int"),
                     _pair(entry, "trace_records", "int"), times, status))
    header = ("scenario", "peak live gathered, % of model", "gathered per training step (fwd + bwd), x model",
              "demand-fetched numel per cycle", "trace re-records", "step time ours/upstream: wall, CPU", "status")
    return tables.markdown_table(header, body, align="lrrrrrl") + "\n"


def markdown_table(summary: Dict[str, dict], meta: dict) -> str:
    out = ["Each cell: upstream 0.19.8 / deepspeed-zero3.", "", markdown_overview(summary)]
    for name, entry in summary.items():
        out.append(f"**{heading(name, entry, meta)}**")
        out.append("")
        out.append(tables.markdown_table(("", "upstream 0.19.8", "deepspeed-zero3", "ours / upstream"),
                                         list(rows(entry))))
        crashed = [rt for rt in RUNTIMES if entry[rt].get("status") not in ("ok", None) and entry[rt].get("error")]
        if crashed:
            out.append("")
            out.extend(f"{rt} {entry[rt]['status']}: `{entry[rt]['error']}`" for rt in crashed)
        out.append("")
    return "\n".join(out)
