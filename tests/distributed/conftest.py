"""Distributed test harness: every rank runs the same tests in the same order, over a real process group.

Run through the launcher (README's test command does):
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank --module pytest tests/distributed

* gloo on CPU, NCCL on GPUs; one process group for the whole session, with a timeout, so a rank
  stuck in a collective fails instead of hanging.
* A test failing on any rank ends that rank's process at once (after pytest reports the failure):
  the launcher then stops the other ranks, so one rank never runs ahead into the next test's
  collectives. The report names the rank.
* Each test has a wall-clock limit (ZERO3_TEST_TIMEOUT, seconds); past it the rank dumps every
  thread's stack and exits.
"""

import datetime
import faulthandler
import os
import sys

import pytest
import torch

import deepspeed
import deepspeed.comm as dist

TEST_TIMEOUT_S = int(os.environ.get("ZERO3_TEST_TIMEOUT", "240"))
PG_TIMEOUT_S = int(os.environ.get("ZERO3_PG_TIMEOUT", "180"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def pytest_configure(config):
    config.addinivalue_line("markers", "world_size(*sizes): run only at these world sizes")
    if "WORLD_SIZE" not in os.environ:
        raise pytest.UsageError("tests/distributed runs under the deepspeed launcher: "
                                "DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank --module pytest tests/distributed")
    if not torch.cuda.is_available():
        # Every rank shares this machine's cores; more threads than cores per rank makes gloo runs ~10x slower.
        local = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def pytest_report_header(config):
    return f"rank {rank()} of {world_size()}, backend {dist.get_backend() if dist.is_initialized() else '?'}"


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("world_size")
        if marker is not None and world_size() not in marker.args:
            item.add_marker(pytest.mark.skip(reason=f"needs world size in {marker.args}, running {world_size()}"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        # Reported here; the rank then leaves so the others stop at their next collective or by the launcher.
        sys.stderr.write(f"\n[rank {rank()}] FAILED {item.nodeid} ({report.when}):\n{report.longreprtext}\n")
        sys.stderr.flush()
        os._exit(1)


def pytest_addoption(parser):
    parser.addoption("--local_rank", default=None, help="accepted for launchers that pass it")


@pytest.fixture(autouse=True)
def _ranks_in_step():
    """Every test starts and ends with all ranks together."""
    dist.barrier()
    yield
    dist.barrier()
