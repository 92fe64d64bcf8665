"""Which runtime a benchmark process runs: the one question every bench worker asks before it reports."""


def runtime_name() -> str:
    """``"ours"`` when deepspeed serves this package's ZeRO-3 modules, ``"upstream"`` under the kill switch (read
    from the file ``deepspeed.runtime.zero.parameter_offload`` was loaded from)."""
    import deepspeed.runtime.zero.parameter_offload as parameter_offload
    return "ours" if "deepspeed_zero3" in (getattr(parameter_offload, "__file__", "") or "") else "upstream"
