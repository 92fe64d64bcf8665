"""The one place that says which upstream DeepSpeed releases this overlay supports.

Kept free of torch and deepspeed imports: the activation hook reads it at
interpreter start.
"""

SUPPORTED_DEEPSPEED_VERSIONS = ("0.19.8", )

# The upstream modules we serve our own implementation for, mapped to ours.
OVERLAID_MODULES = {
    "deepspeed.runtime.zero.partitioned_param_coordinator": "deepspeed_zero3.runtime.zero.partitioned_param_coordinator",
    "deepspeed.runtime.zero.parameter_offload": "deepspeed_zero3.runtime.zero.parameter_offload",
}

KILL_SWITCH_ENV = "DEEPSPEED_ZERO3"
