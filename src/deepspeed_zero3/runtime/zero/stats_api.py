"""Public read-out of the ZeRO-3 counters: ``deepspeed_zero3.get_zero3_stats(engine)``."""

from deepspeed_zero3.runtime.zero.registry_lookup import coordinator_of


def get_zero3_stats(target) -> dict:
    """Counters of the passes run so far: ``{"live_numel", "live_by_reason", "passes": [...], "totals": {kind: ...}}``.

    Each entry of ``passes`` is one forward, eval_forward or backward pass with its all-gather calls
    and numel, demand-fetched and prefetched numel, peak live gathered numel, and trace
    records/mismatches/switches. ``totals`` sums them per pass kind (peak is the maximum). ``live_by_reason``
    splits ``live_numel`` by why each parameter is gathered now ([Note: residency]).
    """
    coordinator = coordinator_of(target)
    with coordinator.lock:
        snapshot = coordinator.stats.snapshot()
        snapshot["live_by_reason"] = coordinator.residency.numel_by_reason()
    return snapshot


def reset_zero3_stats(target) -> None:
    """Forget the counted passes (the live numel stays: it is state, not a counter)."""
    coordinator = coordinator_of(target)
    with coordinator.lock:
        running = coordinator.running
        coordinator.stats.reset(running.stats if running is not None else None)
