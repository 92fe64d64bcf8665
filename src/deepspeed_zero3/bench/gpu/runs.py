"""Launching the GPU worker once per runtime (the kill switch is read at interpreter start)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Optional

from deepspeed_zero3.testing.ports import free_port

RUNTIMES = ("upstream", "ours")
SANITIZER_RACE = "CSAN detected a possible data race"


def worker_env(runtime: str, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(DEEPSPEED_ZERO3="0" if runtime == "upstream" else "1", DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cuda"),
               RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env.update(extra or {})
    return env


def launch(runtime: str, out_dir: Path, name: str, args, timeout_s: int = 300, extra_env=None) -> dict:
    """Run the worker under ``runtime``; returns its result (or {"error": ...}), its rc, seconds and log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{runtime}.json"
    log = out_dir / f"{name}-{runtime}.log"
    command = [sys.executable, "-m", "deepspeed_zero3.bench.gpu.worker", "--out", str(out), *args]
    start = time.time()
    with open(log, "w") as log_file:
        try:
            rc = subprocess.run(command, env=worker_env(runtime, extra_env), stdout=log_file,
                                stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = json.loads(out.read_text()) if rc == 0 and out.exists() else {"error": f"rc={rc}"}
    result.update(rc=rc, seconds=round(time.time() - start, 1), log=str(log))
    return result


def log_tail(result: dict, lines: int = 40) -> str:
    text = Path(result["log"]).read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def log_text(result: dict) -> str:
    return Path(result["log"]).read_text(errors="replace")


def out_dir_from_env() -> Path:
    return Path(os.environ.get("GPU_CHECK_OUT", "gpu-out"))
