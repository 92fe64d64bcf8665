"""tests/gpu (make test-gpu): world size 1 on one CUDA device. Without CUDA every test is skipped, saying so.

Each check launches the worker (deepspeed_zero3.bench.gpu.worker) once per runtime; results and logs go to
$GPU_CHECK_OUT (default gpu-out/), which tools/gpu_check.sh turns into its table.
"""

import pytest

try:
    import torch
    CUDA = torch.cuda.is_available()
    WHY = "" if CUDA else f"no CUDA device (torch {torch.__version__}, built for CUDA {torch.version.cuda})"
except ImportError:  # pragma: no cover - the suite needs torch everywhere else
    CUDA, WHY = False, "torch is not installed"


def pytest_report_header(config):
    return f"tests/gpu: {'running on ' + torch.cuda.get_device_name(0) if CUDA else 'skipping: ' + WHY}"


def pytest_collection_modifyitems(config, items):
    if CUDA:
        return
    skip = pytest.mark.skip(reason=f"tests/gpu need a CUDA device: {WHY}")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)
