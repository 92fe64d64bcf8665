"""Launching the GPU worker once per runtime (the kill switch is read at interpreter start)."""

import json
import os
import sys
from pathlib import Path
from typing import Dict, Optional

from deepspeed_zero3.testing.launching import run, runtime_env

RUNTIMES = ("upstream", "ours")
SANITIZER_RACE = "CSAN detected a possible data race"


def worker_env(runtime: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """One rank and no launcher: the rank's variables are set here, its MASTER_PORT by ``launch``."""
    rank = dict(DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cuda"), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    return runtime_env(runtime, 1, **dict(rank, **(extra or {})))


def launch(runtime: str, out_dir: Path, name: str, args, timeout_s: int = 300, extra_env=None) -> dict:
    """Run the worker under ``runtime``; returns its result (or {"error": ...}), its rc, seconds and log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{runtime}.json"
    log = out_dir / f"{name}-{runtime}.log"
    command = [sys.executable, "-m", "deepspeed_zero3.bench.gpu.worker", "--out", str(out), *args]
    launched = run(lambda port: command, worker_env(runtime, extra_env), timeout_s, log=log,
                   port_variable="MASTER_PORT")
    rc = "timeout" if launched.timed_out else launched.returncode
    result = json.loads(out.read_text()) if rc == 0 and out.exists() else {"error": f"rc={rc}"}
    result.update(rc=rc, seconds=launched.seconds, log=str(log))
    return result


def log_tail(result: dict, lines: int = 40) -> str:
    text = Path(result["log"]).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def log_text(result: dict) -> str:
    return Path(result["log"]).read_text(errors="replace")


def out_dir_from_env() -> Path:
    return Path(os.environ.get("GPU_CHECK_OUT", "gpu-out"))
