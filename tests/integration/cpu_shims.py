"""Test-only shims that let Lightning and Accelerate run DeepSpeed on a machine without GPUs.

Neither library supports DeepSpeed on CPU: they refuse it, or mis-detect it, in their *device*
checks, before DeepSpeed is ever called. Each shim below skips exactly one such check and nothing
else. None of them touches DeepSpeed: ``deepspeed.initialize`` gets the same model, optimizer and
config it would get on a GPU, builds the same engine, and every ZeRO-3 parameter fetch, prefetch
and release goes through the runtime under test (ours, or upstream's with DEEPSPEED_ZERO3=0). On
CPU, DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) supplies gloo collectives.

Lightning 2.6 (``lightning.pytorch.strategies.DeepSpeedStrategy``), three checks, all device-only:

1. ``setup_environment`` raises ``RuntimeError: The DeepSpeed strategy is only supported on CUDA
   GPUs but `CPUAccelerator` is used.`` -- an ``isinstance(self.accelerator, CUDAAccelerator)``
   test. ``CPUDeepSpeedStrategy.setup_environment`` runs the parent class's (DDPStrategy's)
   ``setup_environment`` without it.
2. ``setup_distributed`` calls ``_validate_device_index_selection``, which requires the CUDA device
   index of each process to equal its local rank; CPU devices have index ``None`` (``RuntimeError:
   The selected device indices [None, None] don't match the local rank values of processes``).
   ``CPUDeepSpeedStrategy.setup_distributed`` is the parent's body without that one call:
   ``reset_seed(); set_world_ranks(); _init_deepspeed_distributed()``.
3. Lightning passes ``args=Namespace(device_rank=self.root_device.index)`` to
   ``deepspeed.initialize``; on CPU that index is ``None`` and the engine fails at
   ``if device_rank >= 0`` (``TypeError``). While Lightning calls ``deepspeed.initialize``, a
   ``None`` device_rank is replaced by ``LOCAL_RANK``: what the engine uses when no ``args`` are
   given. Every other argument is passed through untouched.

Accelerate 1.15 (used by the Hugging Face Trainer), one check:

4. ``PartialState._prepare_backend`` looks for an accelerator device; with none found it reports
   ``DistributedType.NO`` and no backend, so a DeepSpeed launch on CPU ends up with
   ``num_processes == 1`` on every rank (no data sharding). With ``cpu=True`` it would pick gloo,
   but that flag also turns DeepSpeed off (the Trainer then never builds a training engine). The
   shim returns what ``cpu=True`` would (``"gloo"``, ``MULTI_CPU``) only when no device was found,
   ``ACCELERATE_USE_DEEPSPEED`` is true and this is a launched rank, and leaves the DeepSpeed path
   of ``PartialState.__init__`` as it is: it still initialises DeepSpeed's process group and sets
   ``DistributedType.DEEPSPEED``.
"""

import argparse
import contextlib
import os

_ACCELERATE_PATCHED = False


# ---------------------------------------------------------------- Lightning


def cpu_deepspeed_strategy(**kwargs):
    """A ``DeepSpeedStrategy(**kwargs)`` that accepts the CPU accelerator (checks 1-3 above)."""
    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.ddp import DDPStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):

        def setup_environment(self) -> None:
            # 1. skip only `isinstance(self.accelerator, CUDAAccelerator)`
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            # 2. DeepSpeedStrategy.setup_distributed without _validate_device_index_selection
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        # 3. the two places where Lightning calls deepspeed.initialize
        def _setup_model_and_optimizer(self, *args, **kwargs):
            with _device_rank_from_local_rank():
                return super()._setup_model_and_optimizer(*args, **kwargs)

        def _initialize_deepspeed_inference(self, *args, **kwargs):
            with _device_rank_from_local_rank():
                return super()._initialize_deepspeed_inference(*args, **kwargs)

    return CPUDeepSpeedStrategy(**kwargs)


@contextlib.contextmanager
def _device_rank_from_local_rank():
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        namespace = kwargs.get("args")
        if namespace is not None and getattr(namespace, "device_rank", 0) is None:
            kwargs["args"] = argparse.Namespace(**{**vars(namespace), "device_rank": int(os.environ["LOCAL_RANK"])})
        return original(*args, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


# ---------------------------------------------------------------- Accelerate


def allow_accelerate_deepspeed_on_cpu():
    """Check 4 above. Call before the first ``TrainingArguments`` is used."""
    global _ACCELERATE_PATCHED
    if _ACCELERATE_PATCHED:
        return
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found_backend, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if (distributed_type == DistributedType.NO and not cpu and os.environ.get("LOCAL_RANK") is not None
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"):
            return "gloo", DistributedType.MULTI_CPU
        return found_backend, distributed_type

    PartialState._prepare_backend = _prepare_backend
    _ACCELERATE_PATCHED = True
