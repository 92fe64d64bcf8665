"""Launching a script under the DeepSpeed launcher from the pytest process, with ours or upstream's runtime.

Shared by test_parity.py and test_checkpoint_cross.py. The runtime is chosen by the kill switch
DEEPSPEED_ZERO3, which is read at interpreter start: one launch per runtime.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

from deepspeed_zero3.testing.ports import LaunchPort, memory_hint

REPO = Path(__file__).resolve().parent.parent.parent


def launch(script: Path, runtime: str, world: int, args, log: Path, timeout_s: int) -> dict:
    """Run ``script *args`` on ``world`` CPU ranks; returns its exit status (or "timeout"), seconds and log."""
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(world), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["DEEPSPEED_ZERO3"] = "0" if runtime == "upstream" else "1"
    launcher = Path(sys.executable).parent / "deepspeed"
    start = time.time()
    with LaunchPort() as port, open(log, "w") as log_file:
        command = [str(launcher), "--num_gpus", str(world), "--master_port", str(port.port), str(script), *args]
        proc = subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the launcher and its ranks, nothing else
            proc.wait()
            rc = "timeout"
    return {"rc": rc, "seconds": round(time.time() - start, 1), "log": log, "port": port.port,
            "shm_freed": port.shm_freed, "memory": memory_hint() if rc != 0 else None}


def log_tail(run, lines=40) -> str:
    text = Path(run["log"]).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:] + ([run["memory"]] if run.get("memory") else []))
