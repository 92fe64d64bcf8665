"""Launching a script under the DeepSpeed launcher from the pytest process, with ours or upstream's runtime.

Shared by test_parity.py and test_checkpoint_cross.py. The runtime is chosen by the kill switch
DEEPSPEED_ZERO3, which is read at interpreter start: one launch per runtime.
"""

from pathlib import Path

from deepspeed_zero3.testing.launching import deepspeed_command, run, runtime_env
from deepspeed_zero3.testing.ports import memory_hint

REPO = Path(__file__).resolve().parent.parent.parent


def launch(script: Path, runtime: str, world: int, args, log: Path, timeout_s: int) -> dict:
    """Run ``script *args`` on ``world`` CPU ranks; returns its exit status (or "timeout"), seconds and log."""
    env = runtime_env(runtime, world, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    launched = run(lambda port: deepspeed_command(world, port, [script, *args]), env, timeout_s, log=log, cwd=REPO)
    rc = "timeout" if launched.timed_out else launched.returncode
    return {"rc": rc, "seconds": launched.seconds, "log": log, "port": launched.port,
            "shm_freed": launched.shm_freed, "memory": memory_hint() if rc != 0 else None}


def log_tail(run, lines=40) -> str:
    text = Path(run["log"]).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:] + ([run["memory"]] if run.get("memory") else []))
