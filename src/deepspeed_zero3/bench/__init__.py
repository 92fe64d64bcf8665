"""Side-by-side benchmark: upstream DeepSpeed 0.19.8's ZeRO-3 parameter runtime against ours.

    python -m deepspeed_zero3.bench            # Model B, 2 ranks, every scenario, results in bench-out/

The driver (``__main__.py``) launches ``worker.py`` twice through the DeepSpeed launcher, once with
``DEEPSPEED_ZERO3=0`` (upstream, untouched) and once with ``DEEPSPEED_ZERO3=1`` (ours), so each runtime
runs in its own processes. Both are measured by the same outside instrument
(``deepspeed_zero3.testing.instrument.GatherMeter``); ``report.py`` turns the two raw JSON files into
one table per scenario and ``plots.py`` draws the live-parameter timeline and the gathered volume.

Importing this package is cheap (no torch, no deepspeed): the driver only needs the names below.
"""

# Canonical order. validate_fit is last: upstream crashes in it, and a crash is the one thing that could
# leave the ranks' collectives out of step for whatever ran after it.
SCENARIOS = (
    "steady_training",
    "train_eval",
    "training_branch",
    "frozen_bottom",
    "generation",
    "tiny_modules",
    "validate_fit",
)

DEFAULT_BUCKET = {"a": 100_000, "b": 20_000}
DEFAULT_STEPS = 5
DEFAULT_WARMUP = 3
RUNTIMES = ("upstream", "ours")
