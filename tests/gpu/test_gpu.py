"""The CUDA path at world size 1 with NCCL, offload_param cpu (pinned) and overlap_comm, in bf16: Model B
and a tiny Hugging Face Llama (from a config, no hub). Every gather is then a pinned host-to-device copy on
the all-gather stream, read by compute (deepspeed_zero3.bench.gpu).

* bitwise parity with upstream (the kill switch, separate processes), over training steps, no-grad forwards
  and the final parameters;
* TORCH_CUDA_SANITIZER=1 reports no race in ours;
* host syncs per training step and per no-grad forward: no more than upstream's;
* peak max_memory_allocated, step time and the fraction of gathering time under compute, ours/upstream, are
  recorded for the table (measured, not asserted: timings are never asserted in tests);
* ZenFlow's parameter path at world size 1, skipped while deepspeed-zero3 refuses ZenFlow.
"""

import json

import pytest

from deepspeed_zero3.bench.gpu.runs import RUNTIMES, SANITIZER_RACE, launch, log_tail, log_text, out_dir_from_env

MODELS = ("b", "llama")
_cache = {}


def pair(model: str) -> dict:
    """Both runtimes' full runs of ``model`` (every phase), once per session."""
    if model not in _cache:
        _cache[model] = {rt: launch(rt, out_dir_from_env(), f"check-{model}", ["--model", model]) for rt in RUNTIMES}
    runs = _cache[model]
    for runtime, result in runs.items():
        assert result["rc"] == 0, f"{runtime} run of model {model} failed:\n{log_tail(result)}"
    assert runs["upstream"]["runtime"] == "upstream" and runs["ours"]["runtime"] == "ours", \
        "the kill switch did not select the runtimes (is the overlay installed, its .pth processed?)"
    return runs


@pytest.mark.parametrize("model", MODELS)
def test_bitwise_parity_with_upstream(model):
    runs = pair(model)
    ours, upstream = runs["ours"], runs["upstream"]
    assert ours["losses"] == upstream["losses"]
    assert ours["param_digest"] == upstream["param_digest"]


@pytest.mark.parametrize("model", MODELS)
def test_host_syncs_no_more_than_upstream(model):
    runs = pair(model)
    ours, upstream = runs["ours"], runs["upstream"]
    assert len(ours["syncs_per_step"]) == len(upstream["syncs_per_step"]) == 2
    for key in ("syncs_per_step", "syncs_per_no_grad_forward"):
        assert all(a <= b for a, b in zip(ours[key], upstream[key])), (key, ours[key], upstream[key])


@pytest.mark.parametrize("model", MODELS)
def test_memory_time_and_overlap_are_recorded(model):
    runs = pair(model)
    for result in runs.values():
        assert result["peak_bytes"] > 0 and result["step_ms"] > 0
        assert result["overlap"]["gather_us"] > 0, "the profiler saw no host-to-device copy: no real gather ran"
    summary = {
        "peak_memory_ratio": runs["ours"]["peak_bytes"] / runs["upstream"]["peak_bytes"],
        "step_time_ratio": runs["ours"]["step_ms"] / runs["upstream"]["step_ms"],
        "overlap_ours": runs["ours"]["overlap"]["fraction"],
        "overlap_upstream": runs["upstream"]["overlap"]["fraction"],
    }
    (out_dir_from_env() / f"summary-{model}.json").write_text(json.dumps(summary, indent=1))


@pytest.mark.parametrize("model", MODELS)
def test_cuda_sanitizer_reports_no_race(model):
    result = launch("ours", out_dir_from_env(), f"sanitizer-{model}",
                    ["--model", model, "--phases", "parity", "--warmup", "2", "--eval-passes", "2"],
                    timeout_s=400, extra_env={"TORCH_CUDA_SANITIZER": "1"})
    text = log_text(result)
    assert SANITIZER_RACE not in text, log_tail(result, 80)
    assert result["rc"] == 0, log_tail(result)


def test_zenflow_parameter_path_at_world_size_1():
    """Placeholder until ZenFlow's parameter-side transposition lands: skipped, by feature, while our runtime
    refuses the ZenFlow config; then parity with upstream like the others."""
    ours = launch("ours", out_dir_from_env(), "zenflow", ["--model", "b", "--zenflow", "--phases", "parity"],
                  timeout_s=400)
    assert ours["rc"] == 0, log_tail(ours)
    if "unsupported" in ours:
        pytest.skip(f"deepspeed-zero3 has no ZenFlow support yet: {ours['unsupported']}")
    upstream = launch("upstream", out_dir_from_env(), "zenflow", ["--model", "b", "--zenflow", "--phases", "parity"],
                      timeout_s=400)
    assert upstream["rc"] == 0, log_tail(upstream)
    assert ours["losses"] == upstream["losses"] and ours["param_digest"] == upstream["param_digest"]
