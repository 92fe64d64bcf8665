"""The soak's plot: RSS, live gathered numel, hooks and trace records against the step, one line per rank.

The second half (the part the slopes are fitted on) is shaded and its RSS fit drawn, and the steps
where a third engine was created and destroyed are marked, so a step in the RSS can be matched to it.
"""

from pathlib import Path

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def plot(result: dict, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = result["meta"]
    fig, axes = plt.subplots(4, 1, figsize=(8, 8.5), dpi=90, sharex=True,
                             gridspec_kw={"height_ratios": [3, 1.2, 1.6, 1.2]})
    rss_ax, live_ax, hooks_ax, traces_ax = axes
    for rank, (record, summary) in enumerate(zip(result["per_rank"], result["ranks"])):
        series, color = record["series"], COLORS[rank % len(COLORS)]
        steps = list(range(1, len(series["rss_kib"]) + 1))
        rss_ax.plot(steps, [v / 1024 for v in series["rss_kib"]], color=color, linewidth=1.2, label=f"rank {rank}")
        start, end = summary["second_half"]
        fitted = summary["rss_slope_kib_per_step"]
        anchor = sum(series["rss_kib"][start:end + 1]) / (end + 1 - start)
        middle = (start + end) / 2
        rss_ax.plot([start + 1, end + 1], [(anchor + fitted * (x - middle)) / 1024 for x in (start, end)],
                    color="black", linestyle="--", linewidth=1)
        live_ax.step(steps, series["live_numel"], where="post", color=color, linewidth=1.2)
        hooks_ax.step(steps, series["zero_hooks"], where="post", color=color, linewidth=1.2,
                      label="ZeRO hooks" if rank == 0 else None)
        hooks_ax.step(steps, series["module_hooks"], where="post", color=color, linewidth=1.2, linestyle=":",
                      label="all hooks on the model (upstream engines' too)" if rank == 0 else None)
        traces_ax.step(steps, series["trace_records"], where="post", color=color, linewidth=1.2)
        third = [i + 1 for i, events in enumerate(record["events"]) if "third_engine" in events]
    for ax in axes:
        ax.axvspan(result["ranks"][0]["second_half"][0] + 1, len(steps), color="0.92", zorder=0)
        ax.grid(alpha=0.3)
    for x in third:
        rss_ax.axvline(x, color="0.6", linewidth=0.6, linestyle=":")
    slopes = ", ".join(f"rank {r} {s['rss_slope_kib_per_step']:.2f}" for r, s in enumerate(result["ranks"]))
    rss_ax.set_ylabel("RSS, MiB")
    rss_ax.set_title(f"soak: {meta['steps']} steps, {meta['model']}, {meta['world']} ranks ({meta['backend']})\n"
                     f"second half shaded, RSS fit dashed ({slopes} KiB/step); dotted: third engine", fontsize=9)
    rss_ax.legend(fontsize=8, loc="lower right")
    live_ax.set_ylabel("live numel\nat step end")
    live_ax.set_ylim(-1, max(1, max(s["live_numel_max"] for s in result["ranks"])) * 1.2)
    hooks_ax.set_ylabel("hooks")
    hooks_ax.legend(fontsize=8, loc="center right")
    traces_ax.set_ylabel("trace records\n(cumulative)")
    traces_ax.yaxis.get_major_locator().set_params(integer=True)
    traces_ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
