"""What the installed deepspeed release offers the runtime, detected once, as features.

[Note: release capabilities]
Every release from 0.16.0 has the single coordinator our two modules replace and calls them the
same way; what differs is upstream internals the runtime uses, which arrived release by release.
Each is detected here by an attribute or a signature, never by a version number, and every
release-conditional line of the runtime reads this module, so a release is supported by what it
has, not by what it is called. Where a release lacks a feature, ours does what that release's own
upstream does:
* GATHERED_CONTEXT_DEPTH_ATTR: ``GatheredParameters`` marks the parameters it holds. Without the
  mark nobody can tell them from others, and ours, like upstream, releases them as any other;
  the weight stream marks its own holds under a name of ours (HELD_MARK_ATTR) instead.
* the eager fallback (DeepCompile): without it, no parameter read is recorded for it.
* FAST_LEAF_SHARDING: without it a threshold chooses z3 leaves and nothing else.
* ZENFLOW: ZenFlow's stage-3 engine, and with it ``zenflow`` as the offload's 4th constructor argument;
  without it, the served constructor takes upstream's arguments of that release, in its order.
* the stage-3 reduce bucket: its shape changed twice; ``clear_reduce_bucket`` empties each shape.
"""

import importlib.util
import os
from typing import Optional

from deepspeed.runtime.zero import partition_parameters

# The attribute GatheredParameters counts its open contexts in, on each parameter it gathered; None if the
# release has no such mark.
GATHERED_CONTEXT_DEPTH_ATTR: Optional[str] = getattr(partition_parameters, "DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR",
                                                     None)
# The mark the runtime reads as "held by an open gather context" and the weight stream sets: upstream's own where
# the release has one (so that upstream refuses a GatheredParameters overlapping the stream), else ours.
HELD_MARK_ATTR: str = GATHERED_CONTEXT_DEPTH_ATTR or "_deepspeed_zero3_gathered_context_depth"


# Upstream's fast sharding of z3 leaves: ``AllGatherCoalescedHandle.free_buffer``, with which the same release brought
# ``wait(handle_dependency=)`` and ``partition(free_data=)``. The attribute is the test: ``wait`` is wrapped (profiling,
# compiler) on some releases, so its signature does not show its arguments.
FAST_LEAF_SHARDING: bool = hasattr(partition_parameters.AllGatherCoalescedHandle, "free_buffer")


def _has_zenflow_stage3() -> bool:
    spec = importlib.util.find_spec("deepspeed.runtime.zenflow")  # imports deepspeed.runtime only, not ZenFlow
    return spec is not None and any(
        os.path.exists(os.path.join(folder, "engine_stage3.py")) for folder in spec.submodule_search_locations or ())


# ZenFlow under stage 3 (the offload's ``zenflow`` argument comes with it).
ZENFLOW: bool = _has_zenflow_stage3()

_UNSET = object()
_fallback_module = _UNSET


def _eager_fallback_module():
    """``deepspeed.compile.z3_eager_fallback``, or None on a release without it. Imported at first use, not
    with this module: it pulls in DeepCompile, which imports the modules we serve."""
    global _fallback_module
    if _fallback_module is _UNSET:
        try:
            from deepspeed.compile import z3_eager_fallback
        except ImportError:
            z3_eager_fallback = None
        _fallback_module = z3_eager_fallback
    return _fallback_module


def active_eager_fallback():
    """The DeepCompile eager fallback running now, or None (always None on a release without one)."""
    module = _eager_fallback_module()
    return None if module is None else module.get_active_z3_eager_fallback()


def is_dynamo_guard_evaluation() -> bool:
    """Whether Dynamo is evaluating a guard (only a release with the check can say it is)."""
    check = getattr(_eager_fallback_module(), "is_dynamo_guard_evaluation", None)
    return bool(check is not None and check())


def record_param_access(fallback, param) -> None:
    """Tell the fallback that an available ``param`` was read, on a release whose fallback tracks reads."""
    record = getattr(fallback, "record_param_access", None)
    if record is not None:
        record(param)


def clear_reduce_bucket(optimizer) -> bool:
    """Empty stage 3's gradient reduce bucket, keeping its buffer: with ``IPGBucketZ3.clear_params`` where the
    release has it, else as it does.

    The bucket is one list per optimizer (``params_in_ipg_bucket``), then one ``IPGBucketZ3`` per communication
    dtype (``ipg_buckets``), which later gained ``clear_params``. Returns False when ``optimizer`` has no bucket.
    """
    buckets = getattr(optimizer, "ipg_buckets", None)
    if buckets is not None:
        for bucket in buckets.values():
            if hasattr(bucket, "clear_params"):
                bucket.clear_params()
            else:
                bucket.params.clear()
                bucket.elements = 0
        return True
    params = getattr(optimizer, "params_in_ipg_bucket", None)
    if params is None:
        return False
    params.clear()
    grads = getattr(optimizer, "grads_in_ipg_bucket", None)
    if grads is not None:
        grads.clear()
    return True


def leave_backward_context(optimizer) -> None:
    """Reset stage 3's count of open ``engine.backward()`` calls, in each release's form (absent before it)."""
    hook_state = getattr(optimizer, "_backward_hook_state", None)
    if hook_state is not None:
        hook_state.backward_active_depth = 0
        hook_state.reset_for_new_step()
    elif hasattr(optimizer, "_backward_active_depth"):
        optimizer._backward_active_depth = 0
