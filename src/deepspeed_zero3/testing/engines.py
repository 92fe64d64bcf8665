"""Building ZeRO-3 engines and deterministic data for tests, the parity suite and the benchmark."""

import copy
from typing import Optional

import torch

import deepspeed


def zero3_config(bucket: int = 100_000, reuse: int = 0, max_live: Optional[int] = None, persistence: int = 0,
                 micro_batch: int = 4, grad_accum: int = 1, **zero_overrides) -> dict:
    """A ZeRO-3 config in fp32 (CPUs here have no fp16), keyed by upstream's ``stage3_*`` names."""
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": persistence,
        "stage3_prefetch_bucket_size": bucket,
        "stage3_max_reuse_distance": reuse,
    }
    if max_live is not None:
        zero["stage3_max_live_parameters"] = max_live
    zero.update(zero_overrides)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def training_engine(model, config: dict, lr: float = 1e-3):
    """An engine with a client torch Adam (no JIT-built optimizer op needed)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=copy.deepcopy(config))
    return engine


def inference_engine(model, config: dict):
    """An engine without optimizer: DeepSpeed builds a DeepSpeedZeRoOffload for it."""
    engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(config))
    return engine


def gathered_copies(params) -> list:
    """Full copies of ZeRO-3 parameters (gathered on every rank), for bitwise comparison after release."""
    copies = []
    for param in params:
        # One parameter per gather: upstream 0.19.4-0.19.7's GatheredParameters over several parameters waits only
        # for the last gloo all-gather (fixed in 0.19.8), so the others could still be arriving when copied.
        with deepspeed.zero.GatheredParameters([param]):
            copies.append(param.detach().clone())
    return copies


def batch(step: int, rank: int, shape=(4, 16), seed: int = 1234) -> torch.Tensor:
    """The same input for the same (step, rank) in every run, whatever the runtime."""
    generator = torch.Generator().manual_seed(seed + 7919 * step + 104729 * rank)
    return torch.randn(*shape, generator=generator)


def token_batch(step: int, rank: int, batch_size=4, seq=16, vocab=128, seed: int = 4321):
    generator = torch.Generator().manual_seed(seed + 7919 * step + 104729 * rank)
    tokens = torch.randint(0, vocab, (batch_size, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def mse_loss(output: torch.Tensor) -> torch.Tensor:
    """A bounded loss for the MLPs (their outputs grow fast under Adam at lr 1e-3)."""
    return torch.nn.functional.mse_loss(torch.tanh(output), torch.zeros_like(output))


def train_step(engine, x) -> float:
    loss = mse_loss(engine(x))
    engine.backward(loss)
    engine.step()
    return loss.item()
