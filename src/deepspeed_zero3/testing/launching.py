"""Starting a script under a launcher, one runtime at a time, and stopping it: shared by every benchmark entry point
and the launching tests.

A launch runs in its own session (process group), so a timeout or Ctrl-C stops the launcher and every rank it
started, and nothing else; its port's shared-memory buffers are released when it ends, however it ends
(``ports.LaunchPort``). The runtime is chosen by the kill switch ``DEEPSPEED_ZERO3``, read at interpreter start.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from deepspeed_zero3.testing.ports import LaunchPort

KILL_SWITCH = "DEEPSPEED_ZERO3"
POLL_S = 0.5


def find_launcher() -> str:
    """The ``deepspeed`` launcher next to this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "deepspeed"
    if beside.exists():
        return str(beside)
    found = shutil.which("deepspeed")
    if found is None:
        sys.exit(f"no `deepspeed` launcher next to {sys.executable} or on PATH; install deepspeed==0.19.8")
    return found


def accelerator() -> str:
    """``DS_ACCELERATOR`` if set, else cuda where torch sees a GPU, else cpu."""
    if os.environ.get("DS_ACCELERATOR"):
        return os.environ["DS_ACCELERATOR"]
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def runtime_env(runtime: str, world: int, **extra: str) -> Dict[str, str]:
    """This process's environment for a launch of ``runtime`` ("upstream" sets the kill switch) on ``world``
    ranks of this machine."""
    if runtime not in ("upstream", "ours", "overlay"):
        raise ValueError(f"runtime {runtime!r} is not one of 'upstream', 'ours' (or 'overlay')")
    # An accelerator given in ``extra`` spares the torch import accelerator() needs to pick one.
    env = dict(os.environ, DS_ACCELERATOR=extra.get("DS_ACCELERATOR") or accelerator(), LOCAL_SIZE=str(world),
               PYTHONUNBUFFERED="1")
    env[KILL_SWITCH] = "0" if runtime == "upstream" else "1"
    env.update(extra)
    return env


def deepspeed_command(world: int, port: int, target: Sequence[str]) -> List[str]:
    """``deepspeed --num_gpus <world> --master_port <port> <target...>``."""
    return [find_launcher(), "--num_gpus", str(world), "--master_port", str(port), *target]


def stop_group(proc: subprocess.Popen) -> None:
    """End a launch started by ``run``: SIGTERM to its session, then SIGKILL if it is still there 15 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def read_json(path: Path):
    """The JSON a launch wrote to ``path``; None while it is missing or half-written (rank 0 rewrites it as it runs)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class Launched:
    returncode: Optional[int]  # None: stopped at the timeout
    seconds: float
    port: int
    shm_freed: int
    timed_out: bool = False
    loadavg: Optional[List[float]] = None  # 1-minute load average before and after


def run(command: Callable[[int], Sequence[str]], env: Dict[str, str], timeout: float, log: Optional[Path] = None,
        cwd=None, on_poll: Optional[Callable[[], None]] = None, port_variable: Optional[str] = None) -> Launched:
    """Run ``command(port)`` (a fresh free port) in its own session until it exits or ``timeout`` seconds pass.

    Output goes to ``log`` (created, with the command as its first line) or to this process's stdout. ``on_poll``
    is called every POLL_S seconds while it runs (progress bars). A timeout or KeyboardInterrupt stops the whole
    launch; the port's shm buffers are released in every case. ``port_variable`` names a variable of ``env`` to
    set to the port as well: a rank started without a launcher reads its rendezvous port from ``MASTER_PORT``.
    """
    start, load_before = time.time(), os.getloadavg()[0]
    timed_out, returncode = False, None
    with LaunchPort() as port:
        argv = [str(a) for a in command(port.port)]
        if port_variable is not None:
            env = dict(env, **{port_variable: str(port.port)})
        handle = open(log, "w") if log is not None else None
        try:
            if handle is not None:
                shown_env = " ".join(f"{k}={env[k]}" for k in (KILL_SWITCH, "DS_ACCELERATOR", "LOCAL_SIZE") if k in env)
                handle.write(f"$ {shown_env} {' '.join(argv)}\n")
                handle.flush()
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT if handle else None,
                                    start_new_session=True)
            try:
                while True:
                    try:
                        returncode = proc.wait(timeout=POLL_S if on_poll is not None else max(timeout, 1))
                    except subprocess.TimeoutExpired:
                        pass
                    if on_poll is not None:
                        on_poll()
                    if returncode is not None:
                        break
                    if time.time() - start > timeout:
                        timed_out = True
                        stop_group(proc)
                        break
            except KeyboardInterrupt:
                stop_group(proc)
                raise
        finally:
            if handle is not None:
                handle.close()
    return Launched(returncode, round(time.time() - start, 1), port.port, port.shm_freed, timed_out,
                    [round(load_before, 2), round(os.getloadavg()[0], 2)])
