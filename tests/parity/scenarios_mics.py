"""Parity scenario: MiCS (``zero_optimization.mics_shard_size``) where the installed deepspeed has it (run by scenarios.py).

deepspeed 0.19.4 to 0.19.6 still ship MiCS; 0.19.7 removed it. With ``mics_shard_size`` 2, ``deepspeed.initialize``
builds upstream's ``MiCS_Optimizer``, whose ``MiCS_Offload`` subclasses the served ``DeepSpeedZeRoOffload`` (ours
under our runtime) and partitions the parameters with ``MiCS_Init`` within shard groups of 2 ranks. Our
coordinator then gathers through each parameter's ``all_gather_coalesced``, which MiCS replaced with its own.

On the CPU, upstream's MiCS cannot gather at all: its all-gather goes through ``dist.all_gather_coalesced``, which
opens a coalescing manager, and gloo has none ("Backend gloo does not implement startCoalescing"), under either
runtime. So the scenario records what does run (the engine's classes, each parameter's partition and MiCS groups)
and how far training gets and why it stops; where it trains (NCCL), it records losses and the final parameters.
tests/parity/test_parity.py's ``test_mics_runs_as_far_as_upstream`` compares all of it with upstream.

Self-contained: it uses only the ``run`` object scenarios.py passes in.
"""

import importlib.util
import os
import traceback

import torch

import deepspeed

from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import tiny_mlp

STEPS = 5
SHARD = 2
MICS_FILE = os.path.join("deepspeed", "runtime", "zero", "mics.py")


def mics_shard_2(run, args):
    """MiCS with shard groups of 2 ranks: initialize, then train as far as the backend allows."""
    if importlib.util.find_spec("deepspeed.runtime.zero.mics") is None:
        run.extra["mics_absent"] = f"deepspeed {deepspeed.__version__} has no MiCS (removed in 0.19.7)"
        return
    torch.manual_seed(67)
    model = tiny_mlp()
    engine = run.engine(training_engine(model, zero3_config(bucket=200, reuse=0, mics_shard_size=SHARD)))
    offload = engine.optimizer.parameter_offload
    run.extra["offload_mro"] = [f"{c.__module__}.{c.__qualname__}" for c in type(offload).__mro__]
    run.extra["same_classes"] = [type(engine.optimizer).__name__, type(offload).__name__]
    run.extra["same_layout"] = [(name, p.ds_numel, p.ds_tensor.ds_numel, p.comm.param_shard_size,
                                 p.comm.param_repli_size) for name, p in model.named_parameters()]
    rank = torch.distributed.get_rank()
    for step in range(STEPS):
        try:
            run.loss(train_step(engine, batch(step, rank, shape=(4, 8))))
        except RuntimeError as exc:
            if "startCoalescing" not in str(exc):
                raise
            frames = traceback.extract_tb(exc.__traceback__)
            run.extra["same_stopped"] = f"step {step}: {type(exc).__name__}: {exc}"
            # Where it stopped: MiCS's own all-gather, under both runtimes.
            run.extra["same_stopped_in"] = [f.name for f in frames if f.filename.endswith(MICS_FILE)]
            return
    run.hash_params(model)
