"""The benchmark's two plots (matplotlib, Agg backend, small PNGs).

* ``timeline.png``: live gathered numel after each fetch across one steady-state training step
  (forward then backward), upstream and ours, with the forward/backward boundary marked;
* ``volume.png``: gathered numel per pass, as a multiple of the model, upstream and ours, for every
  scenario and pass kind.
"""

from pathlib import Path
from typing import Dict, List, Optional

from deepspeed_zero3.bench import RUNTIMES
from deepspeed_zero3.bench.report import PASS_KINDS

COLORS = {"upstream": "#d62728", "ours": "#1f77b4"}
NAMES = {"upstream": "upstream 0.19.8", "ours": "deepspeed-zero3"}
TIMELINE_SCENARIOS = ("steady_training", "train_eval", "frozen_bottom", "training_branch", "generation")


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _timeline_source(raw: Dict[str, dict]) -> Optional[str]:
    """The first scenario whose last cycle has a forward and a backward timeline in both runtimes."""
    for name in TIMELINE_SCENARIOS:
        records = [((raw.get(rt) or {}).get("scenarios") or {}).get(name) or {} for rt in RUNTIMES]
        if all(r.get("status") == "ok" and r.get("timeline", {}).get("forward") and r["timeline"].get("backward")
               for r in records):
            return name
    return None


def plot_timeline(raw: Dict[str, dict], path: Path) -> Optional[Path]:
    name = _timeline_source(raw)
    if name is None:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=90)
    boundaries = {}
    for rt in RUNTIMES:
        record = raw[rt]["scenarios"][name]
        forward, backward = record["timeline"]["forward"], record["timeline"]["backward"]
        values = [100.0 * v / record["numel"] for v in forward + backward]
        ax.step(range(1, len(values) + 1), values, where="post", color=COLORS[rt], label=NAMES[rt], linewidth=1.8)
        boundaries[rt] = len(forward) + 0.5
    for rt, x in boundaries.items():
        ax.axvline(x, color="0.4" if len(set(boundaries.values())) == 1 else COLORS[rt], linestyle="--", linewidth=1)
    x = min(boundaries.values())
    top = 105
    ax.text(x - 0.4, top * 0.97, "forward", ha="right", va="top", fontsize=9, color="0.3")
    ax.text(x + 0.4, top * 0.97, "backward", ha="left", va="top", fontsize=9, color="0.3")
    meta = raw["ours"]["meta"]
    record = raw["ours"]["scenarios"][name]
    ax.set_ylim(0, top)
    ax.set_xlabel("fetch (submodule) within one steady-state training step")
    ax.set_ylabel("live gathered, % of model")
    ax.set_title(f"{name}: {record['label']} ({record['numel']:,} params), {meta['world']} ranks, "
                 f"bucket {meta['bucket']:,}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_volume(summary: Dict[str, dict], path: Path) -> Optional[Path]:
    groups: List[tuple] = []
    for name, entry in summary.items():
        for kind in PASS_KINDS:
            values = [entry[rt].get(f"{kind}_x") for rt in RUNTIMES]
            if any(v is not None for v in values):
                groups.append((f"{name}\n{kind}", values))
    if not groups:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(groups) + 1.5), 3.8), dpi=90)
    width = 0.4
    for offset, rt in zip((-width / 2, width / 2), RUNTIMES):
        xs = [i + offset for i, (_, values) in enumerate(groups) if values[RUNTIMES.index(rt)] is not None]
        ys = [values[RUNTIMES.index(rt)] for _, values in groups if values[RUNTIMES.index(rt)] is not None]
        ax.bar(xs, ys, width, color=COLORS[rt], label=NAMES[rt])
    ax.axhline(1.0, color="0.3", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([label for label, _ in groups], fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("gathered per pass, x model")
    ax.set_title("all-gather volume per pass (steady state; a crashed run has no bar)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
