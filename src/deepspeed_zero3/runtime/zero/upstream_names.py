"""Upstream's module-level names of the two modules we serve, kept in one place.

[Note: upstream's module names]
Tests and client code import and patch module-level names of the two modules we replace
(upstream's eager-fallback tests patch ``parameter_offload.print_rank_0``), so each served
module has every module-level name upstream's has (``tests/unit/test_module_api.py`` reads
the list from the installed upstream files). The rules:
* a name upstream imports is imported here: the same object, including upstream's star
  import of ``partition_parameters``, so the set follows the installed deepspeed;
* a name upstream defines for its own bookkeeping is defined here and does the same thing,
  or raises saying what to use instead;
* debug lines go through the served module's name at call time, so a patch takes effect.
Both served modules re-export this module; their own classes and functions come after it.
"""

# ---------------------------------------------------------------- names upstream imports
import collections  # noqa: F401
import logging  # noqa: F401
import sys  # noqa: F401
import threading  # noqa: F401
from collections import OrderedDict, UserDict  # noqa: F401
from dataclasses import dataclass  # noqa: F401
from enum import Enum
from typing import Deque, Dict, Set  # noqa: F401

import torch  # noqa: F401
from torch.nn import Module, Parameter

import deepspeed.runtime.compiler as compiler  # noqa: F401
from deepspeed import comm as dist
from deepspeed import utils  # noqa: F401
from deepspeed.accelerator import get_accelerator  # noqa: F401
from deepspeed.runtime.compiler import is_compiling  # noqa: F401
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus  # noqa: F401
from deepspeed.runtime.utils import see_memory_usage  # noqa: F401
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum  # noqa: F401
from deepspeed.runtime.zero.partition_parameters import *  # noqa: F401,F403
from deepspeed.runtime.zero.partition_parameters import _init_external_params  # noqa: F401
from deepspeed.runtime.zero.partitioned_param_profiler import PartitionedParameterProfiler  # noqa: F401
from deepspeed.runtime.zero.utils import apply_to_tensors_only, is_zero_param  # noqa: F401
from deepspeed.utils import set_z3_leaf_module, z3_leaf_module  # noqa: F401
from deepspeed.utils.debug import debug_param2name_id_shape  # noqa: F401
from deepspeed.utils.debug import debug_module2name_id, debug_param2name_id  # noqa: F401 (0.16's coordinator)
from deepspeed.utils.logging import logger

try:  # deepspeed >= 0.19.5, whose parameter_offload imports it
    from deepspeed.utils.pin_memory_tracker import pinned_memory_summary  # noqa: F401
except ImportError:
    pass

from deepspeed_zero3.runtime.zero.module_params import named_fetch_params
from deepspeed_zero3.runtime.zero.registry_lookup import module_coordinator

# ---------------------------------------------------------------- partitioned_param_coordinator's own

# Upstream's switch for its PartitionedParameterProfiler: read when a coordinator is built ([Note: upstream's event
# timings], profiling.py).
ENABLE_PROFILER = False


def coordinator_debug_rank0(message: str) -> None:
    """Upstream's coordinator's own ``debug_rank0`` (served there under that name). Its parameter_offload has
    partition_parameters' from the star import, the same body with the argument named ``msg``."""
    if dist.get_rank() == 0:
        logger.debug(message)


def get_all_parameters(sub_module: Module, recurse: bool = False):
    """``(name, parameter)`` pairs one fetch of ``sub_module`` covers: its own, then its external ones."""
    return named_fetch_params(sub_module, recurse)


class ZeRoTraceMode(Enum):
    """Upstream's trace states. Ours keeps a trace per pass (trace.py); a coordinator answers
    ``is_record_trace()``, ``is_complete_trace()`` and ``is_invalid_trace()`` for the pass running."""
    RECORD = 1
    COMPLETE = 2
    INVALID = 3


def update_recompute_parameters(sub_module: Module, param: Parameter) -> None:
    """Upstream's attribution of a frozen parameter gathered while a checkpoint recomputes to the backward module
    running: ``param`` is released with ``sub_module``'s post-backward (or with the pass, if that never comes).
    Our runtime does not need it ([Note: release at last use in a recompute]) but honours it for callers."""
    sub_module.__dict__.setdefault("ds_recompute_parameters", set()).add(param)
    coordinator = module_coordinator(sub_module)
    running = coordinator.running if coordinator is not None else None
    if running is not None:
        running.recompute_owners[id(sub_module)] = sub_module
    served = sys.modules.get("deepspeed_zero3.runtime.zero.partitioned_param_coordinator")
    announce = getattr(served, "print_rank_0", print_rank_0)  # noqa: F405 (partition_parameters' own)
    announce(f"update_recompute_parameters  {sub_module.ds_id=} to {param.ds_id=}", force=False)
