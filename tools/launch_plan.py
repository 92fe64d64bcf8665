"""Which accelerator and how many ranks ``make demo`` launches on this machine: prints ``<accelerator> <ranks>``.

The accelerator follows torch (``torch.cuda.is_available()``), not ``nvidia-smi``: with a driver too old for the
installed torch, a GPU is listed that torch cannot use, and forcing DeepSpeed to cuda would fail at its first
tensor. The demo runs one rank per GPU (at least 1); on a CPU it runs 2 ranks over gloo, so the run really is
sharded. ``make`` writes the answer to ``<venv>/.launch-plan`` once, after the venv is built.
"""

import sys
from typing import Tuple

CPU_RANKS = 2


def decide(cuda_available: bool, device_count: int) -> Tuple[str, int]:
    """(accelerator, ranks) for the demo, from what torch reports."""
    if cuda_available and device_count >= 1:
        return "cuda", device_count
    return "cpu", CPU_RANKS


def main() -> int:
    import torch

    accelerator, ranks = decide(torch.cuda.is_available(), torch.cuda.device_count())
    print(accelerator, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
