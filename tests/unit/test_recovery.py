"""abandon_step refuses what is not an engine: a module alone would keep stage 3's partial gradients."""

import pytest
from torch import nn

import deepspeed_zero3


def test_abandon_step_needs_the_engine():
    with pytest.raises(TypeError, match="abandon_step expects the engine returned by deepspeed.initialize; "
                       "got Linear"):
        deepspeed_zero3.abandon_step(nn.Linear(2, 2))
