"""Parity scenarios: LoRA with activation checkpointing under ZeRO-3 (run by scenarios.py).

The model: ``LoRADecoder`` (below), the shape of a LoRA fine-tune with gradient checkpointing: a frozen
embedding fed token ids, blocks of a frozen norm and two LoRA projections (a frozen base Linear plus trainable
rank-4 adapters), each block under ``torch.utils.checkpoint``, and a trainable head. Non-reentrant, the first
block's input needs no grad, so its base projections have no backward of their own: their recompute is their
last use ([Note: release at last use in a recompute]). Reentrant, the embedding output is made to require grad,
as Hugging Face's ``enable_input_require_grads`` does for that mode.

Compared with upstream, bitwise: losses and the final parameters. Not compared: the gathered numel, which is the
runtime's own: ``backward_peak_live_numel`` (the meter's peak over each backward, per step) and
``backward_gathered_numel`` are recorded, and pinned for ours by tests/distributed/test_recompute_release.py.

Self-contained: it uses only the ``run`` object scenarios.py passes in.
"""

import os

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.testing.engines import training_engine, zero3_config
from deepspeed_zero3.testing.instrument import GatherMeter

STEPS = 5
VOCAB = 64
WIDTH = 128
RANK = 4
BLOCKS = 3
BASE_NUMEL = WIDTH * WIDTH + WIDTH  # one frozen base Linear, weight and bias


class LoRALinear(nn.Module):

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)  # non-zero, so that the adapters' gradients differ

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class Block(nn.Module):

    def __init__(self, width: int, rank: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.norm.requires_grad_(False)
        self.attn = LoRALinear(width, rank)
        self.mlp = LoRALinear(width, rank)

    def forward(self, x):
        return x + self.mlp(torch.tanh(self.attn(self.norm(x))))


class LoRADecoder(nn.Module):

    def __init__(self, use_reentrant: bool):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.embed.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(WIDTH, RANK) for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, tokens):
        h = self.embed(tokens)
        if self.use_reentrant:
            h.requires_grad_(True)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(h).float().pow(2).mean()


def tokens(step: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(977 + 7919 * step + 104729 * rank)
    return torch.randint(0, VOCAB, (4, 8), generator=generator)


class GatheredNumel:
    """The numel each parameter's ``all_gather_coalesced`` (what both parameter runtimes gather with) is asked to
    gather: of the parameters given, those ``NOT_AVAILABLE``."""

    def __init__(self, model: nn.Module):
        self.numel = 0
        for param in model.parameters():
            param.all_gather_coalesced = self._wrap(param.all_gather_coalesced)

    def _wrap(self, original):
        def counted(params, *args, **kwargs):
            self.numel += sum(p.ds_numel for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
            return original(params, *args, **kwargs)

        return counted

    def take(self) -> int:
        numel, self.numel = self.numel, 0
        return numel


def train(engine, model, steps: int, rank: int):
    """``steps`` training steps; per step the loss, the meter's peak live numel over the backward and the numel the
    backward gathered."""
    losses, peaks, gathered = [], [], []
    counter = GatheredNumel(model)
    with GatherMeter(model) as meter:
        for step in range(steps):
            with meter.phase("forward"):
                loss = engine(tokens(step, rank))
            counter.take()
            with meter.phase("backward") as backward:
                engine.backward(loss)
            gathered.append(counter.take())
            with meter.phase("step"):
                engine.step()
            losses.append(loss.item())
            peaks.append(backward.peak_live_numel)
            meter.reset()
    return losses, peaks, gathered


def build(use_reentrant: bool, own=lambda engine: engine):
    torch.manual_seed(53)
    model = LoRADecoder(use_reentrant)
    return model, own(training_engine(model, zero3_config(bucket=0, reuse=0)))


def _lora_checkpointing(run, use_reentrant: bool):
    model, engine = build(use_reentrant, run.engine)
    losses, peaks, gathered = train(engine, model, STEPS, int(os.environ.get("RANK", "0")))
    for value in losses:
        run.loss(value)
    run.extra["backward_peak_live_numel"] = peaks  # the runtime's own (not compared), as is the next
    run.extra["backward_gathered_numel"] = gathered
    run.hash_params(model)


def lora_checkpointing_nonreentrant(run, args):
    """LoRA blocks under non-reentrant checkpointing, the first block's input needing no grad."""
    _lora_checkpointing(run, use_reentrant=False)


def lora_checkpointing_reentrant(run, args):
    """LoRA blocks under reentrant checkpointing, the embedding output made to require grad."""
    _lora_checkpointing(run, use_reentrant=True)
