"""Parity scenarios behind the on-purpose differences with upstream's own tests (docs/compat/upstream-differences.md).

Self-contained: they use only the ``run`` object scenarios.py passes in.
"""

import os
from pathlib import Path

import torch

import deepspeed

from deepspeed.utils import set_z3_leaf_modules

from deepspeed_zero3.testing.engines import batch, training_engine, zero3_config

STEPS = 5


def _ours() -> bool:
    return os.environ.get("DEEPSPEED_ZERO3", "1") not in ("0", "false", "off", "no")


class CounterLeaf(torch.nn.Module):
    """Upstream's ``ChooseModuleByCounter``: the root, made a z3 leaf, uses one of two Linears per call."""

    def __init__(self, hidden: int = 32):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden, bias=False) for _ in range(2)])
        self.counter = 0

    def forward(self, x, y):
        out = torch.relu(self.linears[self.counter % 2](x))
        self.counter += 1
        return out, torch.nn.functional.cross_entropy(out, y)


# Stage 3 itself refuses a z3 leaf whose inputs need no grad up to 0.17.6 (its own leaf hook raises, with either
# runtime): read from the installed stage3.py, the one place that says it.
STAGE3_REFUSES_NO_GRAD_LEAF = "cannot be set as a leaf module when it does not have any input tensors" in (
    Path(deepspeed.__file__).parent / "runtime" / "zero" / "stage3.py").read_text()


def z3_leaf_root_no_grad_inputs(run, args):
    """The root is a z3 leaf and its inputs do not require grad: upstream's backward fails (``The size of tensor a
    (0) must match``, the leaf's weights released before it), and upstream's test expects a RuntimeError. Ours
    trains; it is compared with upstream trained the supported way, the same inputs requiring grad, bitwise."""
    if STAGE3_REFUSES_NO_GRAD_LEAF:
        run.release_lacks("refuses a z3 leaf whose inputs need no grad in stage 3's own hook (until 0.18.0)")
    torch.manual_seed(61)
    model = CounterLeaf()
    set_z3_leaf_modules(model, [CounterLeaf])
    engine = run.engine(training_engine(model, zero3_config(bucket=32 * 32, reuse=0)))
    rank = int(os.environ.get("RANK", "0"))
    for step in range(STEPS):
        x = batch(step, rank, shape=(4, 32)).requires_grad_(not _ours())
        y = torch.arange(4) + step
        loss = engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        run.loss(loss.item())
    run.hash_params(model)


def single_linear_root_memory_efficient(run, args):
    """A root that is one ``nn.Linear`` under ``memory_efficient_linear`` and reuse 0 (upstream's
    ``TestZero3LinearDirectInit``): ours keeps the weight gathered from the forward for its backward, a model
    smaller than one bucket ([Note: budgeted keeping]); upstream releases it after the forward. Values bitwise."""
    torch.manual_seed(62)
    model = torch.nn.Linear(16, 8)
    engine = run.engine(training_engine(model, zero3_config(bucket=50_000_000, reuse=0, memory_efficient_linear=True)))
    rank = int(os.environ.get("RANK", "0"))
    for step in range(STEPS):
        loss = engine(batch(step, rank)).square().mean()
        engine.backward(loss)
        engine.step()
        run.loss(loss.item())
    run.hash_params(model)
