"""Checkpoints cross-load between our runtime and upstream's, and training then goes on bitwise as if uninterrupted.

An ordinary single-process pytest: a module fixture runs tests/parity/checkpoint_cross.py three times, one
after the other, at world size 2 (Model B, client Adam, small prefetch buckets):

1. ours: train steps 0..2, save checkpoint A, train steps 3..5 (the uninterrupted reference);
2. upstream (kill switch): a fresh engine loads A and trains steps 3..5; then another trains steps 0..2
   from the seed of launch 1 and saves checkpoint B;
3. ours: a fresh engine loads B and trains steps 3..5.

Losses of every rank and the sha256 of the final full parameters must equal launch 1's bit for bit. The
engines that load start from other weights than the saved run, so equality cannot come from the seed.
"""

import json
import os
from pathlib import Path

import pytest

from launching import launch, log_tail

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "checkpoint_cross.py"
LAUNCH_TIMEOUT_S = int(os.environ.get("ZERO3_CKPT_CROSS_LAUNCH_TIMEOUT", "180"))
WORLD = 2
# (name, runtime, arguments), in the order they must run: each loads what an earlier one saved.
LAUNCHES = (
    ("ours_saves_a", "overlay", ("--save", "{a}", "--then-continue")),
    ("upstream_loads_a_saves_b", "upstream", ("--load", "{a}", "--save", "{b}")),
    ("ours_loads_b", "overlay", ("--load", "{b}")),
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pytestconfig):
    out_dir = tmp_path_factory.mktemp("ckpt_cross")
    paths = {"a": out_dir / "ckpt_a", "b": out_dir / "ckpt_b"}
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    done = {}
    for name, runtime, args in LAUNCHES:
        out = out_dir / f"{name}.json"
        args = [arg.format(**paths) for arg in args] + ["--out", str(out)]
        run = done[name] = launch(SCRIPT, runtime, WORLD, args, out_dir / f"{name}.log", LAUNCH_TIMEOUT_S)
        run["results"] = json.loads(out.read_text()) if out.exists() else {}
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write_line(f"checkpoint cross launch {name} ({runtime}): {run['seconds']} s, "
                                    f"rc {run['rc']}; log {run['log']}")
    return done


def part(runs, name, key) -> dict:
    """What launch ``name`` recorded for ``key``; a failure names the launch and shows its log's tail."""
    run = runs[name]
    recorded = run["results"].get(key)
    assert run["rc"] == 0 and recorded is not None, (
        f"launch {name} (rc {run['rc']}) did not record {key!r}: {run['results'].get('error')}\n"
        f"log {run['log']}:\n{log_tail(run)}")
    assert all(len(losses) == 3 for losses in recorded["losses_by_rank"]), recorded
    assert len(recorded["losses_by_rank"]) == WORLD and recorded["params_sha256"], recorded
    return recorded


def assert_same(got, expected, what):
    for rank, (a, b) in enumerate(zip(got["losses_by_rank"], expected["losses_by_rank"])):
        assert a == b, (f"{what}: rank {rank} losses {[float.fromhex(v) for v in a]} "
                        f"!= {[float.fromhex(v) for v in b]}")
    assert got["params_sha256"] == expected["params_sha256"], f"{what}: final parameters differ (losses equal)"


@pytest.mark.parametrize("name,runtime", [(n, r) for n, r, _ in LAUNCHES], ids=[n for n, _, _ in LAUNCHES])
def test_launch_used_the_intended_runtime(runs, name, runtime):
    run = runs[name]
    results = run["results"]
    assert results.get("runtime") == runtime, f"launch {name}: {results}\n{log_tail(run)}"
    for module in ("parameter_offload", "partitioned_param_coordinator"):
        assert ("deepspeed_zero3" in results[module]) == (runtime == "overlay"), (name, results[module])
    assert results["parameter_offload_name"].startswith("deepspeed_zero3.") == (runtime == "overlay"), results
    assert results["world"] == WORLD


def test_upstream_trains_like_ours_before_saving(runs):
    assert_same(part(runs, "upstream_loads_a_saves_b", "trained"), part(runs, "ours_saves_a", "trained"),
                "upstream's steps 0..2 vs ours")


def test_upstream_resumes_from_our_checkpoint(runs):
    assert_same(part(runs, "upstream_loads_a_saves_b", "resumed"), part(runs, "ours_saves_a", "continued"),
                "upstream resumed from our checkpoint vs our uninterrupted run")


def test_ours_resumes_from_upstreams_checkpoint(runs):
    assert_same(part(runs, "ours_loads_b", "resumed"), part(runs, "ours_saves_a", "continued"),
                "ours resumed from upstream's checkpoint vs our uninterrupted run")
