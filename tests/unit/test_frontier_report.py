"""The frontier report reads upstream's curve at our peak (bench/frontier.py); no launch needed."""

from deepspeed_zero3.bench import frontier


def side(peak, forward_x, backward_x, cpu=100.0):
    return dict(status="ok", peak_live_pct=peak, forward_x=forward_x, backward_x=backward_x, demand_per_cycle=0,
                step_cpu_ms=cpu, step_ms=2 * cpu)


def test_pareto_drops_dominated_points_and_read_at_interpolates():
    pts = {"a": dict(peak=100.0, gathered=1.0), "b": dict(peak=100.0, gathered=1.58),
           "c": dict(peak=50.0, gathered=1.5), "d": dict(peak=60.0, gathered=1.6)}
    front = frontier.pareto(pts)
    assert [(p["peak"], p["gathered"]) for p in front] == [(50.0, 1.5), (100.0, 1.0)]
    assert frontier.read_at(front, 75.0, "gathered") == 1.25
    assert frontier.read_at(front, 40.0, "gathered") is None  # below upstream's lowest peak
    assert frontier.read_at(front, 120.0, "gathered") == 1.0


def test_markdown_has_one_row_per_point_with_ratios():
    summary = {}
    for i, name in enumerate(frontier.FRONTIER_SCENARIOS):
        summary[name] = {"upstream": side(20.0 + 10 * i, 1.0, 0.8 - 0.1 * i, cpu=100.0),
                         "ours": side(20.0 + 10 * i, 1.0, 0.7 - 0.1 * i, cpu=90.0)}
    text = frontier.markdown(summary)
    lines = text.strip().splitlines()
    assert len(lines) == 2 + len(frontier.FRONTIER_SCENARIOS)
    assert "| default | 0 |" in lines[2]
    assert lines[2].endswith("| 0.94, 0.90 |")  # 1.7 / 1.8 gathered, 90 / 100 CPU ms
