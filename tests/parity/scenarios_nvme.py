"""Parity scenario: NVMe parameter offload (ZeRO-Infinity) on the per-pass prefetchers.

Upstream's working set-up on the CPU accelerator: bf16, partitions of at
least 1 MiB so that they really go to NVMe, ``max_in_cpu: 0``. The swap files live under a per-run temporary
folder that the scenario removes.
"""

import shutil
import tempfile

import torch

from deepspeed.ops.op_builder import AsyncIOBuilder

import deepspeed_zero3
from deepspeed_zero3.testing.engines import batch, mse_loss, training_engine, zero3_config
from deepspeed_zero3.testing.models import ResidualMLP

NVME_STEPS = 5
# One Linear(1024, 1024) and its bias: the window holds one big layer ahead of the one in use.
NVME_BUCKET = 1_100_000
UNAVAILABLE = "async_io op not available (install libaio-dev, then `make venv` builds the op)"


def nvme_config(swap_dir: str, bucket: int = NVME_BUCKET, buffer_count: int = 5) -> dict:
    config = zero3_config(bucket=bucket, reuse=0,
                          offload_param={"device": "nvme", "nvme_path": swap_dir, "pin_memory": False,
                                         "buffer_count": buffer_count, "buffer_size": 600_000, "max_in_cpu": 0},
                          offload_optimizer={"device": "cpu"})
    config["bf16"] = {"enabled": True}
    # The scenario's client torch Adam (no JIT-built CPU Adam op) runs on the offloaded optimizer states.
    config["zero_force_ds_cpu_optimizer"] = False
    return config


def nvme_model() -> ResidualMLP:
    """4.2M parameters; each Linear(1024, 1024) weight is a 1 MiB bf16 partition on each of 2 ranks."""
    return ResidualMLP(inp=16, width=1024, hidden=1024, blocks=2, out=4)


def swap_dir_for_all_ranks() -> str:
    """One folder name, made on rank 0 and shared (the swapper adds rank<N>/ below it)."""
    name = [tempfile.mkdtemp(prefix="zero3-nvme-") if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


def nvme_unavailable():
    """Why NVMe parameter offload cannot run here (a pytest skip reason), None if it can."""
    if not AsyncIOBuilder().is_compatible():
        return UNAVAILABLE
    if swap_pool_needs_accelerator_pinning():
        return ("this deepspeed release asserts that its NVMe swap buffers are pinned by the accelerator, which pins "
                "nothing here (the CPU accelerator): its swapper cannot start, under either runtime")
    return None


def swap_pool_needs_accelerator_pinning() -> bool:
    """Whether this release's swap buffer pool asserts that the accelerator pinned its buffers (before it asked
    the aio handle, as later releases do), where this accelerator pins nothing (the CPU one): its swapper cannot start
    under either runtime."""
    import inspect

    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.swap_tensor.utils import SwapBufferPool

    if "aio_handle" in inspect.signature(SwapBufferPool.__init__).parameters:
        return False
    accelerator = get_accelerator()
    return not accelerator.is_pinned(accelerator.pin_memory(torch.empty(8, dtype=torch.uint8)))


def nvme_param_offload(run, args):
    """Training steps and no-grad eval forwards with every big partition on NVMe; losses and parameters bitwise."""
    if not AsyncIOBuilder().is_compatible():
        run.extra["unavailable"] = UNAVAILABLE
        raise RuntimeError(UNAVAILABLE)
    if swap_pool_needs_accelerator_pinning():
        run.release_lacks("asserts that its NVMe swap buffers are pinned by the accelerator, which pins nothing here "
                          "(the CPU accelerator): its swapper cannot start")
    rank = torch.distributed.get_rank()
    swap_dir = swap_dir_for_all_ranks()
    try:
        torch.manual_seed(21)
        model = nvme_model()
        engine = run.engine(training_engine(model, nvme_config(swap_dir)))
        on_nvme = sum(str(p.ds_tensor.final_location) == "OffloadDeviceEnum.nvme" for p in model.parameters())
        run.extra["params_on_nvme"] = on_nvme
        for step in range(NVME_STEPS):
            engine.train()
            x = batch(step, rank).to(torch.bfloat16)
            loss = mse_loss(engine(x).float())
            engine.backward(loss)
            engine.step()
            run.loss(loss.item())
            with torch.no_grad():
                run.loss(mse_loss(engine(batch(100 + step, rank).to(torch.bfloat16)).float()).item())
        if "deepspeed_zero3" in type(engine.optimizer.parameter_offload).__module__:
            passes = deepspeed_zero3.get_zero3_stats(engine)["passes"]
            run.extra["swap_ins"] = [{k: p[k] for k in ("kind", "swap_in_ahead", "swap_in_demand", "swap_in_unused")}
                                     for p in passes]
        run.hash_params(model)
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(swap_dir, ignore_errors=True)
