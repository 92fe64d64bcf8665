"""The one place that says which upstream DeepSpeed releases this overlay supports.

Kept free of torch and deepspeed imports: the activation hook reads it at
interpreter start.
"""

# Every release listed here has been run through `make test-versions` (docs/compat/versions.md). setup.py
# derives the pip requirement (the span from first to last) from it, the activation hook checks membership,
# and the Makefile reads it for DEEPSPEED_VERSION. How a new release gets added: README, "Upstream versions".
# Below 0.19.4 upstream lacks internals our modules import (DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR).
SUPPORTED_DEEPSPEED_VERSIONS = ("0.19.4", "0.19.5", "0.19.6", "0.19.7", "0.19.8")

# Every torch release listed here has been run through `make test-versions` with the newest supported deepspeed
# (docs/compat/versions.md's torch table; the Makefile's TORCH_VERSIONS is this list). setup.py requires torch from
# the first minor series to the last.
MEASURED_TORCH_VERSIONS = ("2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0")

# The upstream modules we serve our own implementation for, mapped to ours.
OVERLAID_MODULES = {
    "deepspeed.runtime.zero.partitioned_param_coordinator": "deepspeed_zero3.runtime.zero.partitioned_param_coordinator",
    "deepspeed.runtime.zero.parameter_offload": "deepspeed_zero3.runtime.zero.parameter_offload",
}

KILL_SWITCH_ENV = "DEEPSPEED_ZERO3"


def describe_supported(versions=SUPPORTED_DEEPSPEED_VERSIONS) -> str:
    """``0.19.4-0.19.8`` for a run of consecutive patch releases, else the list; for messages."""
    keys = [tuple(int(part) for part in v.split(".")) for v in versions]
    consecutive = all(a[:2] == b[:2] and b[2] == a[2] + 1 for a, b in zip(keys, keys[1:]))
    if len(versions) > 2 and consecutive:
        return f"{versions[0]}-{versions[-1]}"
    return ", ".join(versions)
