"""CPU shims for two helpers of upstream's test suite, applied by ``make compat`` to its scratch copy only.

[Note: CPU shims for upstream's test helpers]
Two helpers of upstream's GPU-minded tests fail on DeepSpeed's CPU accelerator before the test reaches
DeepSpeed, under either runtime, so the tests built on them would measure nothing here:
* the DDP baselines (``test_zero_user_backward.py``) pass ``device_ids=[rank]``, where ``rank`` is
  ``current_device()``, the string ``LOCAL_RANK`` on CPU, which torch's DDP refuses for a CPU module;
* ``unit.common.reduce_boolean_flags`` makes its tensors on device ``'0'`` ("Invalid device string")
  and all-gathers a 0-d tensor into a world-size buffer, which gloo refuses.
``install`` runs from a line appended to the copied ``unit/common.py`` (every test process imports it).
On the CPU accelerator it leaves DDP's ``device_ids``/``output_device`` unset for a CPU module, as torch
asks, and replaces ``reduce_boolean_flags`` with one that uses the device name and a one-element tensor.
No test body or assertion changes, both runtimes get the same shims, and a row run with them says so.
On a GPU accelerator ``install`` does nothing.
"""

from pathlib import Path

MARK = "# deepspeed-zero3 compat shims"
NAMES = ("ddp_cpu_device_ids", "reduce_boolean_flags_on_cpu")


def apply(tests: Path) -> None:
    """Append the ``install`` call to the scratch copy of upstream's ``unit/common.py``."""
    common = tests / "unit" / "common.py"
    text = common.read_text()
    if MARK in text:
        return
    common.write_text(text + f"\n\n{MARK} (tools/compat_shims.py); this line is not upstream's\n"
                      "import compat_shims as _zero3_compat_shims\n_zero3_compat_shims.install(globals())\n")


def install(common_namespace: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    _leave_cpu_ddp_device_ids_unset()
    common_namespace["reduce_boolean_flags"] = _reduce_boolean_flags


def _leave_cpu_ddp_device_ids_unset() -> None:
    from torch.nn.parallel import DistributedDataParallel

    original = DistributedDataParallel.__init__
    if getattr(original, "zero3_compat_shim", False):
        return

    def __init__(self, module, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        original(self, module, *args, **kwargs)

    __init__.zero3_compat_shim = True
    DistributedDataParallel.__init__ = __init__


def _reduce_boolean_flags(flag: bool, op=all) -> bool:
    import torch
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    if not dist.is_initialized():
        return flag
    device = get_accelerator().current_device_name()
    mine = torch.tensor([1 if flag else 0], dtype=torch.int, device=device)
    everyone = torch.zeros(dist.get_world_size(), dtype=torch.int, device=device)
    dist.all_gather_into_tensor(everyone, mine)
    return op([bool(f) for f in everyone.tolist()])
