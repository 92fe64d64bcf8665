"""Unit tests run on CPU, in one process (plus a few subprocesses in test_activation.py)."""

import os

# Before anything imports deepspeed: pick the CPU accelerator rather than probing for CUDA.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
