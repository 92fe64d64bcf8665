"""Lightning 2.6 + DeepSpeedStrategy(stage=3) on 2 ranks (CPU, gloo; see cpu_shims.py).

Every flow is checked against the plain-PyTorch reference (reference.py): each rank's loss at every
training and validation batch, and the final parameters. Upstream 0.19.8 (kill switch) is run on
the same flows: it crashes on validate-then-fit with a single validation batch (the reported
failure), and on the other flows its losses and parameters equal ours bitwise.

Upstream's crash needs steps that call a submodule (`self.net(x)`), as the flows do. With steps
that call `self(x)` (validate_fit_1_call_self) the root module is entered twice per step and
upstream's root pre-hook calls reset_step twice: the second call closes the trace before any
module is recorded, the first module of the step then invalidates that empty trace, and upstream
never holds a recorded trace, so never reaches the code that crashes.
"""

import pytest
import torch

from common import assert_flows_ok, assert_upstream_deque_crash
from harness import AGAINST_UPSTREAM, MAIN_RUNTIME
from reference import replay_lightning

SCRIPT = "lightning_flows.py"
LOSS_RTOL = 1e-5   # observed <= 7.1e-7: gradient sums in another order (see reference.py)
PARAM_ATOL = 1e-4  # observed <= 3.8e-5, on one element whose Adam second moment is ~0; a step is ~1e-3

T4 = ["train"] * 4
EXPECTED_EVENTS = {
    "validate_fit_1": ["val", "optimizer", *T4, "val"],
    "validate_fit_1_call_self": ["val", "optimizer", *T4, "val"],
    "validate_fit_3": ["val"] * 3 + ["optimizer", *T4] + ["val"] * 3,
    "frozen_mid": ["optimizer", *T4, "val", "val", *T4, "val", "val"],
    "sanity_interval": ["optimizer", "val", "val", "train", "train", "val", "val", "train", "train", "val", "val"],
    "fit_fit": ["optimizer", *T4, "val", "optimizer", *T4, "val"],
    "validate_fit_validate_fit": ["val", "val", "optimizer", *T4, "val", "val"] * 2,
}
FLOWS = list(EXPECTED_EVENTS)
UPSTREAM_CRASHES = ["validate_fit_1"]
UPSTREAM_PASSES = [f for f in FLOWS if f not in UPSTREAM_CRASHES]


@pytest.fixture(scope="module")
def ours(launches):
    # upstream's crash ends a launch: with ZERO3_INTEGRATION_AGAINST_UPSTREAM=1 it must come last
    return launches(SCRIPT, UPSTREAM_PASSES + UPSTREAM_CRASHES, upstream=AGAINST_UPSTREAM)


@pytest.mark.parametrize("flow", FLOWS)
def test_flow_matches_reference(ours, flow):
    results = ours.results(flow)
    assert_flows_ok(results, MAIN_RUNTIME, EXPECTED_EVENTS[flow])
    for result in results:
        for event in result["events"]:
            if event["kind"] == "optimizer":
                continue
            assert event["grad_enabled"] == (event["kind"] == "train")
            # the frozen submodule stays in eval mode throughout; otherwise Lightning's own modes
            assert event["mid_training"] == (flow != "frozen_mid" and event["kind"] == "train"), event
    events = [r["events"] for r in results]
    expected, expected_params = replay_lightning(events, frozen_mid=(flow == "frozen_mid"))
    for rank in range(2):
        got = [e["loss"] for e in events[rank] if e["kind"] != "optimizer"]
        assert got == pytest.approx(expected[rank], rel=LOSS_RTOL), f"rank {rank}"
    params = ours.params(flow)
    assert params.keys() == expected_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, expected_params[name], rtol=0, atol=PARAM_ATOL, msg=name)
    if flow == "frozen_mid":
        for name, value in params.items():
            if name.startswith("mid."):
                assert torch.equal(value, expected_params[name])  # frozen: never touched


def test_upstream_crashes_on_validate_then_fit_with_one_batch(launches, needs_both_runtimes):
    """The reported failure, reproduced with the kill switch: fit's first forward dies in reset_step."""
    run = launches(SCRIPT, UPSTREAM_CRASHES, upstream=True)
    # validation ran, fit built its optimizer, and no training step completed
    assert_upstream_deque_crash(run.results("validate_fit_1"), events=["val", "optimizer"])
    assert run.returncode != 0


@pytest.mark.parametrize("flow", UPSTREAM_PASSES)
def test_upstream_passes_and_equals_ours_bitwise(launches, needs_both_runtimes, ours, flow):
    run = launches(SCRIPT, UPSTREAM_PASSES, upstream=True)
    for rank in range(2):
        theirs, mine = run.result(flow, rank), ours.result(flow, rank)
        assert theirs["runtime"] == "upstream"
        assert theirs["status"] == "ok", theirs.get("traceback")
        assert theirs["events"] == mine["events"]  # every loss, exactly
    theirs, mine = run.params(flow), ours.params(flow)
    assert all(torch.equal(theirs[name], mine[name]) for name in mine)
