"""Hugging Face Trainer (transformers 5.x, Accelerate 1.x) with a ZeRO-3 DeepSpeed config on 2 ranks.

A tiny Llama built from a config; random token tensors. Each rank's loss at every training step and
evaluation batch is checked against the plain-PyTorch reference (reference.py); upstream 0.19.8
(kill switch) runs the same flows.

`Trainer.evaluate()` then `Trainer.train()` on ONE Trainer does not work with DeepSpeed in
transformers 5.24, whatever the ZeRO runtime: `train()` finds the inference engine from
`evaluate()` in `trainer.model_wrapped`, takes the model as already wrapped, skips
`accelerator.prepare`, and the first `accelerator.backward` meets `deepspeed_engine_wrapped is None`.
That is recorded below, under both runtimes. The two-engine flow is run the way the Trainer
supports: `evaluate()` with one Trainer, `train()` with a second one over the same model.
"""

import pytest

from common import assert_flows_ok, assert_upstream_deque_crash
from harness import AGAINST_UPSTREAM, MAIN_RUNTIME
from reference import replay_hf

SCRIPT = "hf_flows.py"
LOSS_RTOL = 1e-5  # observed <= 2e-7 (see reference.py)

EXPECTED_EVENTS = {
    "evaluate_then_train": ["eval", "optimizer"] + ["train"] * 4,
    "train_periodic_eval": ["optimizer"] + ["train", "train", "eval", "eval"] * 3,
}
SAME_TRAINER = "evaluate_then_train_same_trainer"
# A crash ends a launch: the flow that crashes in transformers (under both runtimes) runs last, and
# before it the one upstream crashes on (for ZERO3_INTEGRATION_AGAINST_UPSTREAM=1).
OURS = ["train_periodic_eval", "evaluate_then_train", SAME_TRAINER]
UPSTREAM_OK_THEN_SAME_TRAINER = ["train_periodic_eval", SAME_TRAINER]


@pytest.fixture(scope="module")
def ours(launches):
    return launches(SCRIPT, OURS, upstream=AGAINST_UPSTREAM)


@pytest.mark.parametrize("flow", list(EXPECTED_EVENTS))
def test_flow_matches_reference(ours, flow):
    results = ours.results(flow)
    assert_flows_ok(results, MAIN_RUNTIME, EXPECTED_EVENTS[flow])
    events = [r["events"] for r in results]
    assert events[0] != events[1]  # the ranks trained on different batches
    expected = replay_hf(events)
    for rank in range(2):
        got = [e["loss"] for e in events[rank] if e["kind"] != "optimizer"]
        assert got == pytest.approx(expected[rank], rel=LOSS_RTOL), f"rank {rank}"


def test_upstream_crashes_on_evaluate_then_train_with_a_second_trainer(launches, needs_both_runtimes):
    run = launches(SCRIPT, ["evaluate_then_train"], upstream=True)
    assert_upstream_deque_crash(run.results("evaluate_then_train"), events=["eval", "optimizer"])


def test_upstream_periodic_eval_equals_ours_bitwise(launches, needs_both_runtimes, ours):
    run = launches(SCRIPT, UPSTREAM_OK_THEN_SAME_TRAINER, upstream=True)
    for rank in range(2):
        theirs, mine = run.result("train_periodic_eval", rank), ours.result("train_periodic_eval", rank)
        assert theirs["runtime"] == "upstream"
        assert theirs["status"] == "ok", theirs.get("traceback")
        assert theirs["events"] == mine["events"]


def test_same_trainer_evaluate_then_train_fails_in_transformers_under_both_runtimes(launches, needs_both_runtimes,
                                                                                   ours):
    upstream = launches(SCRIPT, UPSTREAM_OK_THEN_SAME_TRAINER, upstream=True)
    for run, runtime in ((ours, "overlay"), (upstream, "upstream")):
        for rank, result in enumerate(run.results(SAME_TRAINER)):
            assert result["runtime"] == runtime
            assert result["status"] == "crash", f"{runtime} rank {rank}: transformers now supports this flow"
            assert result["error_type"] == "AttributeError"
            assert result["error"] == "'NoneType' object has no attribute 'backward'"
            assert "self.deepspeed_engine_wrapped.backward" in result["traceback"]
            # evaluation ran, train() made its optimizer and ran the first forward (through the inference engine)
            assert [e["kind"] for e in result["events"]] == ["eval", "eval", "optimizer", "train"]
    # up to the failure, both runtimes computed the same losses
    for rank in range(2):
        assert ours.result(SAME_TRAINER, rank)["events"] == upstream.result(SAME_TRAINER, rank)["events"]
