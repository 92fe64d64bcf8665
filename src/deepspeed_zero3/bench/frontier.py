"""``python -m deepspeed_zero3.bench --frontier``: the memory / traffic / time frontier of both runtimes.

Model A (6,312,196 parameters), bucket 100,000, training steps only, at every combination of
``stage3_max_live_parameters`` in {default 1e9, 50%, 25%, 10% of the model} and
``stage3_max_reuse_distance`` in {0, default 1e9}: eight scenarios, each run by both runtimes (one launch
per runtime, as for the other scenarios). Per point: peak live gathered numel, gathered numel per training
step, demand-fetched numel, CPU time and wall time per step.

A user picks a point by the memory they can spare, so the comparison is at equal peak memory: for each
of our points, upstream's frontier (the lowest gathered volume upstream reaches at a peak no higher,
linearly interpolated between its Pareto points) is read at our peak, and so is upstream's CPU time
along the same points.
"""

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from deepspeed_zero3.bench import RUNTIMES
from deepspeed_zero3.bench.tables import markdown_table
from deepspeed_zero3.testing.models import MODEL_A_NUMEL

DEFAULT = 1_000_000_000
CAPS = (("default", None), ("50%", 0.5), ("25%", 0.25), ("10%", 0.1))
REUSES = (("0", 0), ("default", DEFAULT))


def scenario_name(cap_label: str, reuse_label: str) -> str:
    return f"frontier_cap_{cap_label.rstrip('%')}_reuse_{reuse_label}"


POINTS = {scenario_name(c, r): (c, fraction, r, reuse) for c, fraction in CAPS for r, reuse in REUSES}
FRONTIER_SCENARIOS = tuple(POINTS)


def _frontier_scenario(name: str):
    cap_label, fraction, reuse_label, reuse = POINTS[name]

    def scenario(bench):
        import torch

        from deepspeed_zero3.bench.scenarios import Plan
        from deepspeed_zero3.testing.engines import training_engine, zero3_config
        from deepspeed_zero3.testing.models import model_a

        torch.manual_seed(7)
        model = model_a()
        cap = None if fraction is None else int(MODEL_A_NUMEL * fraction)
        engine = training_engine(model, zero3_config(bucket=bench.args.bucket, reuse=reuse, max_live=cap))
        return Plan(model, lambda i: bench.train_step(engine, i),
                    f"Model A, cap {cap_label}, reuse {reuse_label}", [engine])

    scenario.__name__ = name
    return scenario


FRONTIER_FUNCTIONS = {name: _frontier_scenario(name) for name in FRONTIER_SCENARIOS}

# ---------------------------------------------------------------------------------------------- report


def point(side: dict) -> Optional[dict]:
    """(peak %, gathered per step x model, demand per step, CPU ms, wall ms) of one runtime at one point."""
    if side.get("forward_x") is None or side.get("backward_x") is None:
        return None
    return dict(peak=side["peak_live_pct"], gathered=side["forward_x"] + side["backward_x"],
                demand=side["demand_per_cycle"], cpu_ms=side["step_cpu_ms"], wall_ms=side["step_ms"])


def points(summary: Dict[str, dict]) -> Dict[str, Dict[str, Optional[dict]]]:
    return {rt: {name: point(summary[name][rt]) for name in FRONTIER_SCENARIOS if name in summary} for rt in RUNTIMES}


def pareto(side: Dict[str, Optional[dict]]) -> List[dict]:
    """The points no other point beats on both peak and gathered, by increasing peak."""
    ordered = sorted((p for p in side.values() if p is not None), key=lambda p: (p["peak"], p["gathered"]))
    front: List[dict] = []
    for p in ordered:
        if not front or p["gathered"] < front[-1]["gathered"]:
            front.append(p)
    return front


def read_at(front: List[dict], peak: float, key: str) -> Optional[float]:
    """``key`` of the piecewise-linear curve through ``front`` at ``peak``; None below its lowest peak."""
    if not front or peak < front[0]["peak"] - 1e-9:
        return None
    for low, high in zip(front, front[1:]):
        if peak <= high["peak"]:
            if high["peak"] == low["peak"]:
                return min(low[key], high[key])
            t = (peak - low["peak"]) / (high["peak"] - low["peak"])
            return low[key] + t * (high[key] - low[key])
    return front[-1][key]  # above upstream's highest peak: what upstream does with the whole model


def comparison(summary: Dict[str, dict]) -> List[Tuple[str, dict, dict, Optional[float], Optional[float]]]:
    """Per point: (name, upstream, ours, upstream's gathered and CPU ms read off its frontier at our peak)."""
    by_rt = points(summary)
    front = pareto(by_rt["upstream"])
    rows = []
    for name in FRONTIER_SCENARIOS:
        up, ours = by_rt["upstream"].get(name), by_rt["ours"].get(name)
        at_gathered = read_at(front, ours["peak"], "gathered") if ours else None
        at_cpu = read_at(front, ours["peak"], "cpu_ms") if ours else None
        rows.append((name, up, ours, at_gathered, at_cpu))
    return rows


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEADER = ("cap", "reuse", "upstream peak", "upstream gathered / step", "upstream demand / step", "upstream CPU ms",
          "upstream wall ms", "ours peak", "ours gathered / step", "ours demand / step", "ours CPU ms", "ours wall ms",
          "upstream at our peak: gathered, CPU ms", "ours / upstream at equal peak: gathered, CPU")


def markdown(summary: Dict[str, dict]) -> str:
    rows = []
    for name, up, ours, at_gathered, at_cpu in comparison(summary):
        cap, _, reuse, _ = POINTS[name]
        cells = []
        for side in (up, ours):
            side = side or {}
            cells += [_f(side.get("peak"), ".1f") + ("%" if side else ""), _f(side.get("gathered"), ".2f") +
                      ("x" if side else ""), _f(side.get("demand"), ",.0f"), _f(side.get("cpu_ms"), ".0f"),
                      _f(side.get("wall_ms"), ".0f")]
        read = "below upstream's lowest peak" if ours and at_gathered is None else \
            f"{_f(at_gathered, '.2f')}x, {_f(at_cpu, '.0f')}"
        ratios = "-" if not ours or at_gathered is None else \
            f"{ours['gathered'] / at_gathered:.2f}, {ours['cpu_ms'] / at_cpu:.2f}"
        rows.append((cap, reuse, *cells, read, ratios))
    return markdown_table(HEADER, rows, align="ll" + "r" * (len(HEADER) - 2)) + "\n"


def plot(summary: Dict[str, dict], path: Path) -> Optional[Path]:
    """Gathered per step and CPU time per step against peak live memory, one curve per runtime."""
    from deepspeed_zero3.bench.plots import COLORS, NAMES, _pyplot

    by_rt = points(summary)
    if not any(p for side in by_rt.values() for p in side.values()):
        return None
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=90)
    for rt in RUNTIMES:
        named = [(name, p) for name, p in by_rt[rt].items() if p is not None]
        front = pareto(by_rt[rt])
        for ax, key in ((left, "gathered"), (right, "cpu_ms")):
            ax.plot([p["peak"] for p in front], [p[key] for p in front], color=COLORS[rt], linewidth=1.8,
                    label=f"{NAMES[rt]} (frontier)")
            ax.scatter([p["peak"] for _, p in named], [p[key] for _, p in named], color=COLORS[rt], s=22, zorder=3)
            labels: Dict[Tuple[float, float], List[str]] = {}  # points at one spot share one label
            for name, p in named:
                cap, _, reuse, _ = POINTS[name]
                labels.setdefault((round(p["peak"], 1), round(p[key], 2)), []).append(f"{cap}/{reuse}")
            for (x, y), texts in labels.items():
                ax.annotate(", ".join(texts), (x, y), fontsize=6, color=COLORS[rt],
                            xytext=(3, 3 if rt == "ours" else -9), textcoords="offset points")
    left.set_ylabel("gathered per training step, x model")
    right.set_ylabel("CPU time per training step, rank 0, ms")
    for ax in (left, right):
        ax.set_xlabel("peak live gathered, % of model")
        ax.set_xlim(0, 110)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle("Model A, 2 ranks, bucket 100,000: caps {default, 50%, 25%, 10%} x reuse {0, default} "
                 "(labels cap/reuse)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
