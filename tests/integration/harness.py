"""Launching the flow scripts from the pytest process (used by conftest.py and the tests)."""

import json
import os
import sys
from pathlib import Path

from deepspeed_zero3.testing.launching import run
from deepspeed_zero3.testing.ports import memory_hint

HERE = Path(__file__).resolve().parent
# ZERO3_INTEGRATION_AGAINST_UPSTREAM=1 runs the flows meant for our runtime with the kill switch
# instead, and skips the tests that compare the two: it shows which checks upstream fails.
AGAINST_UPSTREAM = os.environ.get("ZERO3_INTEGRATION_AGAINST_UPSTREAM") == "1"
MAIN_RUNTIME = "upstream" if AGAINST_UPSTREAM else "overlay"
LAUNCH_TIMEOUT_S = int(os.environ.get("ZERO3_INTEGRATION_LAUNCH_TIMEOUT", "420"))


class Launch:
    """One torchrun launch of a flow script; ``result(flow, rank)`` reads what that rank wrote."""

    def __init__(self, out: Path, returncode: int, log: Path):
        self.out, self.returncode, self.log = out, returncode, log

    def result(self, flow: str, rank: int = 0) -> dict:
        path = self.out / f"{flow}.rank{rank}.json"
        if not path.exists():
            raise AssertionError(f"{flow}: rank {rank} wrote no result (launcher exit {self.returncode});\n"
                                 f"log tail:\n{self.log_tail()}")
        with open(path) as handle:
            return json.load(handle)

    def results(self, flow: str):
        return [self.result(flow, rank) for rank in (0, 1)]

    def params(self, flow: str):
        import torch

        return torch.load(self.out / f"{flow}.params.pt")

    def log_tail(self, chars: int = 6000) -> str:
        tail = self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"
        return tail + (f"\n{memory_hint()}" if self.returncode != 0 else "")


def launch(script: str, flows, out: Path, upstream: bool) -> Launch:
    """Run ``script --flows ...`` on 2 ranks; upstream=True sets the kill switch DEEPSPEED_ZERO3=0.

    A flow that crashes ends its launch (``finish_flow``): the flows after it are launched again, so that one
    runtime's crash in one flow (upstream's, on some release) leaves the others measured."""
    out.mkdir(parents=True, exist_ok=True)
    remaining, attempt = list(flows), 1
    while True:
        log = out / ("launch.log" if attempt == 1 else f"launch-{attempt}.log")
        returncode = _launch_once(script, remaining, out, upstream, log)
        done = [flow for flow in remaining if (out / f"{flow}.rank0.json").exists()]
        crashed = [flow for flow in done if json.loads((out / f"{flow}.rank0.json").read_text())["status"] != "ok"]
        remaining = [flow for flow in remaining if flow not in done]
        if returncode == 0 or not remaining or not crashed:
            return Launch(out, returncode, log)
        attempt += 1


def _launch_once(script: str, flows, out: Path, upstream: bool, log: Path) -> int:
    # Not runtime_env(): its LOCAL_SIZE would switch on DeepSpeed's CPU shm allreduce, which these torchrun
    # launches have never used, and a GPU machine must still run them on CPU ranks unless told otherwise.
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env["DEEPSPEED_ZERO3"] = "0" if upstream else "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    launched = run(lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", port, HERE / script, "--out", out, "--flows", ",".join(flows)],
                   env, LAUNCH_TIMEOUT_S, log=log, cwd=HERE)
    if launched.timed_out:
        raise AssertionError(f"{script} {flows} ran past {LAUNCH_TIMEOUT_S}s; log tail:\n"
                             f"{log.read_text(errors='replace')[-6000:]}")
    return launched.returncode
