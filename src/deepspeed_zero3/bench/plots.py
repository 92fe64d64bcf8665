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
    ax.text(x - 0.6, 62, "forward", ha="right", va="center", fontsize=9, color="0.3")
    ax.text(x + 0.6, 62, "backward", ha="left", va="center", fontsize=9, color="0.3")
    meta = raw["ours"]["meta"]
    record = raw["ours"]["scenarios"][name]
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_xlabel("fetch (submodule) within one steady-state training step")
    ax.set_ylabel("live gathered, % of model")
    ax.set_title(f"{name}: {record['label']} ({record['numel']:,} params), {meta['world']} ranks, "
                 f"bucket {meta['bucket']:,}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", ncol=2, fontsize=9, frameon=False)
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
                groups.append((f"{name}\n{kind}", values, [entry[rt].get("status") for rt in RUNTIMES]))
    if not groups:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(groups) + 1.5), 3.8), dpi=90)
    width = 0.4
    for offset, rt in zip((-width / 2, width / 2), RUNTIMES):
        column = RUNTIMES.index(rt)
        for i, (_, values, statuses) in enumerate(groups):
            value = values[column]
            if value:
                ax.bar(i + offset, value, width, color=COLORS[rt])
            else:  # a zero is a measurement, a missing value a run that did not get there
                text = "0" if value == 0 else ("crash" if statuses[column] == "crash" else "-")
                ax.text(i + offset, 0.02, text, ha="center", va="bottom", rotation=90, fontsize=7, color=COLORS[rt])
    ax.axhline(1.0, color="0.3", linestyle=":", linewidth=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([group[0] for group in groups], fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("gathered per pass, x model")
    ax.set_title("all-gather volume per pass (steady state)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[rt]) for rt in RUNTIMES]
    ax.legend(handles, [NAMES[rt] for rt in RUNTIMES], fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
