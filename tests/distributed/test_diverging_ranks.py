"""Ranks that run different modules stop with an error on every rank, naming rank, step and module."""

import os

import pytest
import torch

from deepspeed_zero3.runtime.zero.partitioned_param_coordinator import CHECK_RANKS_ENV
from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b


class RankDependent(torch.nn.Module):
    """Skips a block on rank 1 when told to: data-dependent control flow that differs across ranks."""

    def __init__(self):
        super().__init__()
        self.inner = model_b()
        self.diverge = False

    def forward(self, x):
        h = self.inner.inp(x)
        for index, block in enumerate(self.inner.blocks):
            if self.diverge and index == 2 and torch.distributed.get_rank() == 1:
                continue
            h = block(h)
        return self.inner.head(h)


@pytest.fixture
def check_ranks():
    os.environ[CHECK_RANKS_ENV] = "1"
    yield
    del os.environ[CHECK_RANKS_ENV]


def test_debug_mode_names_rank_step_and_module(check_ranks):
    torch.manual_seed(0)
    model = RankDependent()
    engine = training_engine(model, zero3_config(bucket=20_000, reuse=0))
    for step in range(2):
        train_step(engine, batch(step, torch.distributed.get_rank()))
    model.diverge = True
    with pytest.raises(RuntimeError) as info:
        engine(batch(2, torch.distributed.get_rank()))
    message = str(info.value)
    assert f"{CHECK_RANKS_ENV}=1): ranks diverged in a forward pass" in message
    # Steps: 0 root, 1 inp, then 3 per block: step 8 is block 2 on rank 0 and block 3 on rank 1.
    assert "rank 0: step 8 module ds_id=" in message and "rank 1: step 8 module ds_id=" in message
    assert "ZeRO-3 needs every rank to run the same modules" in message
    # Nothing mismatched was issued: the process group still works, and so does the engine.
    model.diverge = False
    assert train_step(engine, batch(3, torch.distributed.get_rank())) > 0
    engine.destroy()


def test_bad_check_ranks_value():
    os.environ[CHECK_RANKS_ENV] = "sometimes"
    try:
        with pytest.raises(ValueError, match=rf"{CHECK_RANKS_ENV}='sometimes' is not allowed: use 1"):
            training_engine(model_b(), zero3_config())
    finally:
        del os.environ[CHECK_RANKS_ENV]
