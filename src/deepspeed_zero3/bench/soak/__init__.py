"""Soak: hundreds of steps mixing training, eval forwards, generation and extra engines over one model.

    python -m deepspeed_zero3.bench.soak            # 500 steps, 2 ranks; soak-out/soak.json, soak-out/soak.png

The driver (``__main__.py``) launches ``worker.py`` on every rank through the DeepSpeed launcher with
our runtime on (``DEEPSPEED_ZERO3=1``). The worker runs the mixed workload (``workload.py``), samples
the runtime's state at the end of every step (``probe.py``), and its rank 0 judges flatness
(``report.py``: slopes over the second half of the run, the pass/fail criteria) and draws the
plot (``plot.py``). Flags live in ``options.py``, shared by the driver and the worker.

Importing this package is cheap (no torch, no deepspeed).
"""
