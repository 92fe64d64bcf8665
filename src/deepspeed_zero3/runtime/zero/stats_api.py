"""Public read-out of the ZeRO-3 counters: ``deepspeed_zero3.get_zero3_stats(engine)``."""

from deepspeed_zero3.runtime.zero.param_registry import find_registry


def coordinator_of(target, api: str = "get_zero3_stats"):
    """The coordinator behind an engine, a ZeRO-3 optimizer, a DeepSpeedZeRoOffload, or a managed module.

    ``api`` names the public function asking, for the error message.
    """
    optimizer = getattr(target, "optimizer", None)
    offload = getattr(optimizer, "parameter_offload", None) or optimizer
    coordinator = getattr(offload, "param_coordinator", None)
    if coordinator is None:
        coordinator = getattr(getattr(target, "parameter_offload", None), "param_coordinator", None)
    if coordinator is None:
        coordinator = getattr(target, "param_coordinator", None)
    if coordinator is None and hasattr(target, "modules"):
        registry = find_registry(target)
        coordinator = registry.coordinator if registry is not None else None
    if coordinator is None or not hasattr(coordinator, "stats"):
        raise ValueError(f"{api} expects a DeepSpeed engine running ZeRO stage 3 with the deepspeed-zero3 "
                         f"runtime (or its module); got {type(target).__name__}. Is the overlay active? "
                         f"Run `python -m deepspeed_zero3`.")
    return coordinator


def get_zero3_stats(target) -> dict:
    """Counters of the passes run so far: ``{"live_numel", "passes": [...], "totals": {kind: ...}}``.

    Each entry of ``passes`` is one forward, eval_forward or backward pass with its all-gather calls
    and numel, demand-fetched and prefetched numel, peak live gathered numel, and trace
    records/mismatches/switches. ``totals`` sums them per pass kind (peak is the maximum).
    """
    return coordinator_of(target).stats.snapshot()


def reset_zero3_stats(target) -> None:
    """Forget the counted passes (the live numel stays: it is state, not a counter)."""
    coordinator_of(target).stats.reset()
