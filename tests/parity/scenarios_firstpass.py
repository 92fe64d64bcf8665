"""Parity scenarios for first-pass prediction and budgeted keeping (run by scenarios.py, both runtimes).

Self-contained: they use only the ``run`` object scenarios.py passes in, so this file imports nothing from it.
"""

import os

import torch

from deepspeed_zero3.testing.engines import batch, mse_loss, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

STEPS = 4


def _x(step: int):
    return batch(step, int(os.environ.get("RANK", "0")))


def capped_default_reuse(run, args):
    """Model B, live-parameter cap at 25% of the model, default reuse distance: a forward keeps the
    backward's first parameters (ours) or the whole model (upstream); train/eval alternation from step 1."""
    torch.manual_seed(21)
    model = model_b()
    engine = run.engine(training_engine(model, zero3_config(bucket=20_000, reuse=10**9, max_live=50_000)))
    for step in range(STEPS):
        engine.train()
        run.loss(train_step(engine, _x(step)))
        engine.eval()
        with torch.no_grad():
            run.loss(mse_loss(engine(_x(100 + step))).item())
    engine.train()
    run.hash_params(model)
