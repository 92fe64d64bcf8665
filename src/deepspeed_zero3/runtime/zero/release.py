"""Releasing a gathered parameter: what upstream's ``param.partition()`` does to it, without its per-call cost.

[Note: releasing a gathered parameter]
For a gathered parameter that has its partition, upstream's ``param.partition()`` only frees
``param.data`` (``free_param``) and marks it NOT_AVAILABLE, but formats six debug messages on the
way that are never printed, one of which walks the parameter's name and shape: a large share of
a release on many small modules. ``release`` frees directly only where ``partition()`` would take
exactly that branch (0.19.4 through 0.19.8 alike): the parameter is AVAILABLE with its partition;
no secondary (hpZ) partition is still to be made; the partition is not on NVMe (upstream then
returns its swap buffer); and ``param.partition`` is upstream's own function (a replacement, as
upstream's eager-fallback tests install, is called). Everything else calls ``param.partition()``.
``free_param`` is looked up on upstream's module at each call, so a patched one applies too.
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
