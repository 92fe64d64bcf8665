"""One table from the GPU runs: ``python -m deepspeed_zero3.bench.gpu.report DIR`` (the worker's JSON files)."""

import json
import sys
from pathlib import Path

from deepspeed_zero3.bench.tables import markdown_table

ROWS = [
    ("step_ms", "step time, ms", "{:.2f}"),
    ("peak_mib", "peak max_memory_allocated, MiB", "{:.1f}"),
    ("syncs_step", "host syncs per training step", "{}"),
    ("syncs_eval", "host syncs per no-grad forward", "{}"),
    ("overlap", "gathering time under compute", "{:.1%}"),
    ("parity", "bitwise parity (losses, parameters)", "{}"),
]


def cells(result: dict) -> dict:
    out = {"step_ms": result.get("step_ms"), "overlap": (result.get("overlap") or {}).get("fraction")}
    if result.get("peak_bytes"):
        out["peak_mib"] = result["peak_bytes"] / 2**20
    for key, field in (("syncs_step", "syncs_per_step"), ("syncs_eval", "syncs_per_no_grad_forward")):
        if result.get(field):
            out[key] = max(result[field])
    return out


def fmt(value, pattern) -> str:
    return "-" if value is None else pattern.format(value)


def table(directory: Path, prefix: str) -> str:
    """A markdown table: one column per runtime and a ratio, one block of rows per model of ``prefix``."""
    rows = []
    for ours_path in sorted(directory.glob(f"{prefix}-*-ours.json")):
        model = ours_path.name[len(prefix) + 1:-len("-ours.json")]
        upstream_path = ours_path.with_name(ours_path.name.replace("-ours.json", "-upstream.json"))
        if not upstream_path.exists():
            continue
        ours, upstream = (json.loads(p.read_text()) for p in (ours_path, upstream_path))
        same = ours.get("losses") == upstream.get("losses") and ours.get("param_digest") == upstream.get("param_digest")
        a, b = cells(upstream), cells(ours)
        a["parity"], b["parity"] = "reference", "yes" if same else "NO"
        for key, label, pattern in ROWS:
            ratio = "-"
            if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float)) and a[key]:
                ratio = f"{b[key] / a[key]:.3f}"
            rows.append((model, label, fmt(a.get(key), pattern), fmt(b.get(key), pattern), ratio))
    return markdown_table(("model", "measure", "upstream", "ours", "ours/upstream"), rows, align="llrrr")


def main(argv):
    directory = Path(argv[1] if len(argv) > 1 else "gpu-out")
    for prefix in argv[2:] or ["check", "bench"]:
        print(f"\n{prefix}:\n" + table(directory, prefix))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
