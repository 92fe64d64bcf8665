"""Parity scenarios: persistence under mixture-of-experts models with z3 leaf modules (run by scenarios.py).

The model: ``MoENet`` (below). Its MoE block routes each token to one expert (top-1) and runs only the experts
that got a token, so which experts compute changes from step to step. DeepSpeed's default
``stage3_param_persistence_threshold`` (100,000) makes every bias, the norm, the router and the two outer
Linears persistent (15 parameters, ``PERSISTENT``); the 8 expert weights (102,400 each) are not.

* ``moe_leaf_block_default_persistence``: the MoE block is the z3 leaf; each rank routes its own batch.
  Every rank runs the same hooked modules in the same order whatever the routing.
* ``moe_expert_leaves_default_persistence``: each expert is a z3 leaf and runs only when routed to, so the
  hooked module order follows the routing, step after step; every rank gets the same batch, so the ranks
  route alike and stay in step. Upstream's trace never completes here (it records a step, sees another order
  the next, invalidates, records again, ...).

Compared with upstream, bitwise: losses, the final parameters, and (``same_*`` keys) which parameters are
persistent and the gathers of persistent parameters in each optimizer step (stage 3's ``_post_step`` gathers all
of them once per step under both runtimes, outside the parameter runtime). Not compared: the persistent gathers
in forward and backward, which are the runtime's own; they are recorded (``persistent_gathers``) and pinned for
ours by tests/distributed/test_persistence_moe.py.

Self-contained: it uses only the ``run`` object scenarios.py passes in.
"""

import os
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch import nn

import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config

STEPS = 5
EXPERTS = 4
WIDTH = 64
HIDDEN = 1600  # expert weights 64 x 1600 = 102,400: just over the default persistence threshold
DEFAULT_PERSISTENCE = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (the key is left unset)
# inp weight + bias, norm weight + bias, router weight, fc1 and fc2 biases of 4 experts, head weight + bias
PERSISTENT = 2 + 2 + 1 + 2 * EXPERTS + 2


class Expert(nn.Module):

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class MoEBlock(nn.Module):
    """Pre-norm residual MoE: top-1 routing, an expert runs only on the tokens routed to it (none: it is skipped)."""

    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN, experts: int = EXPERTS):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width, hidden) for _ in range(experts))
        self.last_routed = []  # the experts that ran in the last forward

    def forward(self, x):
        h = self.norm(x)
        probs = torch.softmax(self.router(h), dim=-1)
        weight, choice = probs.max(dim=-1)
        out = torch.zeros_like(h)
        self.last_routed = []
        for index, expert in enumerate(self.experts):
            tokens = (choice == index).nonzero(as_tuple=True)[0]
            if tokens.numel() == 0:
                continue
            self.last_routed.append(index)
            out = out.index_add(0, tokens, expert(h[tokens]) * weight[tokens].unsqueeze(-1))
        return x + out


class MoENet(nn.Module):

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.moe = MoEBlock()
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.head(self.moe(torch.relu(self.inp(x))))


def moe_config() -> dict:
    """Prefetching on (a bucket smaller than the model), reuse 0, DeepSpeed's default persistence threshold."""
    config = zero3_config(bucket=150_000, reuse=0)
    del config["zero_optimization"]["stage3_param_persistence_threshold"]
    return config


class PersistentGatherCount:
    """Counts the gathers of persistent parameters (``ds_persist``) per phase, the same way for both runtimes.

    Each parameter's ``all_gather_coalesced`` (what both parameter runtimes gather with) and ``all_gather`` (stage
    3's gather of the persistent parameters after each optimizer step, and upstream's of an external parameter)
    are wrapped; a call adds the number of persistent parameters it was given that were ``NOT_AVAILABLE``,
    which are the ones it gathers.
    """

    def __init__(self, model: nn.Module):
        self.counts = defaultdict(int)
        self.phase = "other"
        self.params = list(model.parameters())
        for param in self.params:
            for name in ("all_gather_coalesced", "all_gather"):
                setattr(param, name, self._wrap(param, getattr(param, name)))

    def _wrap(self, owner, original):
        counter = self

        def counted(*args, **kwargs):
            given = args[0] if args else kwargs.get("params", kwargs.get("param_list"))
            params = [owner] if given is None else list(given)
            counter.counts[counter.phase] += sum(
                1 for p in params if getattr(p, "ds_persist", False) and p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
            return original(*args, **kwargs)

        return counted

    @contextmanager
    def counting(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def take(self) -> dict:
        counts, self.counts = dict(self.counts), defaultdict(int)
        return counts


def train_steps(engine, model, meter: PersistentGatherCount, steps: int, rank_of_batch: int):
    """``steps`` training steps on ``batch(step, rank_of_batch)``; per step the loss, the persistent gathers of each
    phase and the experts that ran."""
    losses, gathers, routed = [], [], []
    for step in range(steps):
        with meter.counting("forward"):
            loss = mse_loss(engine(batch(step, rank_of_batch)))
        routed.append(list(model.moe.last_routed))
        with meter.counting("backward"):
            engine.backward(loss)
        with meter.counting("step"):
            engine.step()
        counts = meter.take()
        gathers.append({phase: counts.get(phase, 0) for phase in ("forward", "backward", "step")})
        losses.append(loss.item())
    return losses, gathers, routed


def build(leaf_class, own=lambda engine: engine):
    """MoENet with ``leaf_class`` instances made z3 leaves, its engine (handed to ``own`` at once, so that a
    scenario destroys it even after a crash), and the persistent-gather meter."""
    torch.manual_seed(71)
    model = MoENet()
    leaves = deepspeed.utils.set_z3_leaf_modules(model, [leaf_class])
    assert len(leaves) == (1 if leaf_class is MoEBlock else EXPERTS), leaves
    engine = own(training_engine(model, moe_config()))
    persistent = [name for name, p in model.named_parameters() if p.ds_persist]
    assert persistent == [name for name, p in model.named_parameters() if p.ds_numel <= DEFAULT_PERSISTENCE]
    assert len(persistent) == PERSISTENT, persistent
    return model, engine, persistent, PersistentGatherCount(model)


def _record(run, model, persistent, losses, gathers, routed):
    for value in losses:
        run.loss(value)
    run.extra["same_persistent"] = persistent
    run.extra["same_step_persistent_gathers"] = [g["step"] for g in gathers]
    run.extra["persistent_gathers"] = gathers  # forward and backward: the runtime's own (not compared)
    run.extra["same_routed"] = routed  # the experts that ran on rank 0, step by step
    run.hash_params(model)


def moe_leaf_block_default_persistence(run, args):
    """A top-1 MoE block made a z3 leaf, DeepSpeed's default persistence threshold, five training steps."""
    model, engine, persistent, meter = build(MoEBlock, run.engine)
    losses, gathers, routed = train_steps(engine, model, meter, STEPS, int(os.environ.get("RANK", "0")))
    _record(run, model, persistent, losses, gathers, routed)


def moe_expert_leaves_default_persistence(run, args):
    """Top-1 routing over experts that are z3 leaves, run only when routed to: the module order changes with the
    data (the same batch on every rank). DeepSpeed's default persistence threshold, five training steps."""
    model, engine, persistent, meter = build(Expert, run.engine)
    losses, gathers, routed = train_steps(engine, model, meter, STEPS, 0)
    _record(run, model, persistent, losses, gathers, routed)
