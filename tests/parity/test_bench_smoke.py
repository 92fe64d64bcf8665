"""The side-by-side benchmark (`python -m deepspeed_zero3.bench`) at a tiny size, so it cannot rot.

One driver run (two launches of 2 ranks: upstream with the kill switch, then ours) over two scenarios,
one measured cycle each. Counts are asserted where they are exact; timings never.
"""

import json
import subprocess
import sys

import deepspeed
import pytest

SCENARIOS = ("steady_training", "validate_fit")
TIMEOUT_S = 900


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    cmd = [sys.executable, "-m", "deepspeed_zero3.bench", "--model", "b", "--steps", "1", "--warmup", "2",
           "--scenarios", ",".join(SCENARIOS), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return out, json.loads((out / "results.json").read_text()), proc.stdout


def test_both_runtimes_and_every_scenario(bench):
    out, results, _ = bench
    raw = results["raw"]
    assert set(raw) == {"upstream", "ours"}
    for runtime in ("upstream", "ours"):
        assert raw[runtime]["meta"]["runtime"] == runtime
        assert set(raw[runtime]["scenarios"]) == set(SCENARIOS), runtime
        assert set(results["summary"][name][runtime]["status"] for name in SCENARIOS) <= {"ok", "crash"}
    assert "deepspeed_zero3" in raw["ours"]["meta"]["parameter_offload"]
    assert "deepspeed_zero3" not in raw["upstream"]["meta"]["parameter_offload"]


def test_ours_runs_every_scenario(bench):
    _, results, _ = bench
    for name in SCENARIOS:
        ours = results["summary"][name]["ours"]
        assert ours["status"] == "ok", (name, ours.get("error"))
        assert ours["measured_cycles"] >= 1 and ours["step_ms"] > 0, name


def test_counts_of_a_steady_training_step(bench):
    """Ours gathers each parameter at most once per pass, all of it prefetched, never the whole model at once."""
    _, results, _ = bench
    ours = results["summary"]["steady_training"]["ours"]
    # Model B (199,876) at reuse 0: the forward keeps head (260) + the last down (16,448) for the backward,
    # both back within one bucket ([Note: budgeted keeping]).
    assert ours["forward_x"] == 1.0 and ours["backward_x"] == pytest.approx((199_876 - 16_708) / 199_876, abs=1e-12)
    assert ours["demand_per_cycle"] == 0 and ours["trace_records"] == 0
    assert ours["peak_live_pct"] < 50.0
    upstream = results["summary"]["steady_training"]["upstream"]
    assert upstream["status"] == "ok" and upstream["peak_live_pct"] == 100.0  # upstream gathers the whole model


def test_upstream_crash_is_recorded_not_fatal(bench):
    """Upstream 0.19.8's coordinator stops validate-then-fit with an assertion on a parameter still in flight; the
    driver records it as the scenario's status and goes on (ours' status is checked above)."""
    _, results, _ = bench
    if deepspeed.__version__ != "0.19.8":
        pytest.skip(f"upstream's outcome is measured on deepspeed 0.19.8; this is {deepspeed.__version__}")
    upstream = results["summary"]["validate_fit"]["upstream"]
    assert upstream["status"] == "crash", upstream
    assert upstream["error"].startswith("AssertionError: {'id': ") and "'status': 'INFLIGHT'" in upstream["error"]


def test_table_and_plots(bench):
    out, results, stdout = bench
    for name in SCENARIOS:
        assert name in stdout
    assert "peak live gathered" in stdout and "median step time" in stdout
    for plot in ("timeline.png", "volume.png"):
        path = out / plot
        assert path.exists() and path.stat().st_size > 1000, plot
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    status_rows = [line for line in (out / "table.md").read_text().splitlines() if line.startswith("| status |")]
    assert len(status_rows) == len(SCENARIOS)
