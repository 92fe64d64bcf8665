"""The CPU-testable parts of the GPU checks: trace overlap arithmetic, the table, the wheel-set check."""

import json
import zipfile
from pathlib import Path

from deepspeed_zero3.bench.gpu.overlap import overlap_of
from deepspeed_zero3.bench.gpu.report import table
from repo_scripts import load

REPO = Path(__file__).resolve().parent.parent.parent


def event(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_overlap_counts_gathering_time_under_compute_once():
    trace = {"traceEvents": [
        event("kernel", "ampere_bf16_gemm", 0, 10),
        event("kernel", "elementwise", 5, 10),  # compute 0..15, overlapping itself
        event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 10, 10),  # 10..20: 5 under compute
        event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 50),  # not gathering
        event("kernel", "ncclDevKernel_AllGather_RING_LL", 30, 10),  # 30..40: none under compute
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},  # host side: ignored
    ]}
    assert overlap_of(trace) == {"gather_us": 20.0, "overlapped_us": 5.0, "compute_us": 15.0, "fraction": 0.25}
    assert overlap_of({"traceEvents": [event("kernel", "gemm", 0, 1)]})["fraction"] is None


def test_table_pairs_runtimes_and_flags_parity(tmp_path):
    base = {"losses": ["0x1p-3"], "param_digest": "d", "step_ms": 2.0, "peak_bytes": 2**21,
            "syncs_per_step": [7, 7], "syncs_per_no_grad_forward": [3, 3], "overlap": {"fraction": 0.5}}
    (tmp_path / "check-b-upstream.json").write_text(json.dumps(base))
    (tmp_path / "check-b-ours.json").write_text(json.dumps(dict(base, step_ms=1.0, param_digest="e")))
    text = table(tmp_path, "check")
    assert "| b | step time, ms | 2.00 | 1.00 | 0.500 |" in text
    assert "| b | host syncs per training step | 7 | 7 | 1.000 |" in text
    assert "| b | bitwise parity (losses, parameters) | reference | NO | - |" in text


def wheel(folder, filename, requires):
    name = filename.split("-")[0]
    with zipfile.ZipFile(folder / filename, "w") as archive:
        lines = "".join(f"Requires-Dist: {r}\n" for r in requires)
        archive.writestr(f"{name}-1.0.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\n{lines}")


def test_wheel_check_finds_missing_and_shadowing(tmp_path):
    check_wheels = load("tools/check_wheels.py")
    wheel(tmp_path, "deepspeed-0.19.8-py3-none-any.whl", ["torch>=2.0.0", "hjson", "pytest; extra == 'dev'"])
    wheel(tmp_path, "hjson-3.1.0-py3-none-any.whl", [])
    assert check_wheels.check(tmp_path) == []
    wheel(tmp_path, "pydantic-2.14.4-py3-none-any.whl", ["pydantic-core==2.50.5", "colorama; sys_platform == 'win32'"])
    wheel(tmp_path, "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl", [])
    problems = check_wheels.check(tmp_path)
    assert any("pydantic-core==2.50.5: neither in the set nor on the machine" in p for p in problems), problems
    assert any("torch must not travel" in p for p in problems), problems
    assert not any("colorama" in p for p in problems)
