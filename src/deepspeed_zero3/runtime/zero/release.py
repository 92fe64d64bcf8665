"""Releasing a gathered parameter: what upstream's ``param.partition()`` does to it, without its per-call cost.

[Note: releasing a gathered parameter]
A gathered parameter whose partition already exists (every parameter after
``zero.Init``) is released by ``param.partition()`` in upstream, which for that
case frees ``param.data`` (upstream's ``free_param``) and marks it
NOT_AVAILABLE, and nothing else. On the way it formats six debug messages
that are never printed (four ``print_rank_0(..., force=False)``, two
``see_memory_usage(..., force=False)``), one of which walks the parameter's
name, id, shape and device: on the 2,000-tiny-module benchmark that
formatting is a large share of a release. ``release`` takes the direct path only where upstream's own
``partition()`` would take exactly that branch (0.19.4 through 0.19.8 alike):

* the parameter is AVAILABLE and has its partition (``ds_tensor``);
* no secondary (hpZ) partition is still to be made: without a secondary
  process group ``_partition_param_sec`` is not called, and with one it returns
  at once for a parameter that has its secondary partition;
* the partition does not live on NVMe (upstream then gives its swap buffer back);
* ``param.partition`` is still upstream's own function: a test or a library
  that replaced it on a parameter (upstream's eager-fallback tests do) gets its
  replacement called, as upstream's coordinator would.

Everything else calls ``param.partition()``. ``free_param`` is looked up on
upstream's module at each call, so a patched one applies too.
"""

from torch.nn import Parameter

from deepspeed.runtime.zero import partition_parameters
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

# Where upstream defines the per-parameter ``partition`` closure (Init._convert_to_deepspeed_param).
UPSTREAM_PARTITION_QUALNAME_SUFFIX = "._convert_to_deepspeed_param.<locals>.partition"


def has_upstream_partition(param: Parameter) -> bool:
    return getattr(param.partition, "__qualname__", "").endswith(UPSTREAM_PARTITION_QUALNAME_SUFFIX)


def takes_direct_path(param: Parameter) -> bool:
    """Whether upstream's ``param.partition()`` would only free the data ([Note: releasing a gathered parameter])."""
    partition = param.ds_tensor
    return (param.ds_status is ZeroParamStatus.AVAILABLE and partition is not None
            and (param.ds_secondary_tensor is not None or getattr(param, "ds_zero_param_process_group", None) is None)
            and getattr(partition, "final_location", None) != OffloadDeviceEnum.nvme and has_upstream_partition(param))


def release(param: Parameter) -> None:
    """Partition a gathered ``param`` as ``param.partition()`` does."""
    if takes_direct_path(param):
        partition_parameters.free_param(param)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE
    else:
        param.partition()
