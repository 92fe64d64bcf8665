"""The one-GPU decisions of ``make demo`` (tools/launch_plan.py), with torch's answers given at the boundary."""

import os
import subprocess

import pytest

from repo_scripts import REPO, load

launch_plan = load("tools/launch_plan.py")


@pytest.mark.parametrize("cuda_available, device_count, plan", [
    (True, 1, ("cuda", 1)),
    (True, 8, ("cuda", 8)),
    (False, 0, ("cpu", 2)),
    # nvidia-smi lists a GPU, but the driver is too old for this torch: torch sees none, so neither do we.
    (False, 1, ("cpu", 2)),
    (True, 0, ("cpu", 2)),
])
def test_decide(cuda_available, device_count, plan):
    assert launch_plan.decide(cuda_available, device_count) == plan


def make_dry_run(*args):
    """The demo's launch line as make would run it (make -n), on a venv whose plan file says ``plan``."""
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "NPROC", "MAKEFLAGS", "MFLAGS")}
    return subprocess.run(["make", "-n", "--no-print-directory", "demo", *args], cwd=REPO, capture_output=True,
                          text=True, check=True, env=env).stdout


def test_make_demo_launches_what_the_plan_says(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for stamp in (".installed", ".ops"):  # written after the plan: make finds nothing to rebuild
        (venv / stamp).touch()
    (venv / "bin" / "python").touch()
    (venv / ".launch-plan").write_text("cuda 1\n")
    out = make_dry_run(f"VENV={venv}")
    assert "DS_ACCELERATOR=cuda" in out and "--num_gpus 1 " in out
    out = make_dry_run(f"VENV={venv}", "NPROC=3")
    assert "--num_gpus 3 " in out
    (venv / ".launch-plan").write_text("cpu 2\n")
    assert "--num_gpus 2 " in make_dry_run(f"VENV={venv}")
