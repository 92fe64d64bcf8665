"""``deepspeed_zero3.abandon_step(engine)``: drop a failed step, so training goes on as if it never ran.

[Note: a backward that raised]
An exception inside backward (a custom autograd function, a NaN check in a
hook) stops the autograd engine half way. Nothing of ours sees it happen; the
coordinator learns it later, because the graph task that began the backward pass
never ran the callback queued at its start (``PassProgress.autograd_finished``).
The parameter side then recovers by itself at the next pass boundary: what was
gathered is released and the partial order is not recorded as a trace.

The gradient side is upstream's stage 3 optimizer, and it does not recover: the
gradients that reached its reduce bucket stay there (with ``.grad`` aliasing the
bucket), and the next backward fails upstream's duplicate-parameter assertion in
``__reduce_and_partition_ipg_grads`` (measured with DEEPSPEED_ZERO3=0 as well).
``abandon_step`` empties that bucket through stage 3's own ``clear_params()``
(what its ``step()`` does), drops the module's ``.grad``, and restarts gradient
accumulation, so the gradients of the window so far are discarded: a partially
reduced backward cannot be subtracted from the accumulated partitions.
"""

from deepspeed.runtime.engine import DeepSpeedEngine

from deepspeed_zero3.runtime.zero.stats_api import coordinator_of


def abandon_step(engine) -> None:
    """Discard the running step of ``engine`` after an exception in its forward or backward.

    Releases every gathered parameter at once and closes the open pass without keeping it as a trace; drops
    the gradients computed since the last optimizer step (the faulted backward's included). The next
    forward/backward/step then trains as if the abandoned micro-batches had never been seen. Idempotent;
    call it on every rank that abandons (all of them, as for any collective step).
    """
    if not isinstance(engine, DeepSpeedEngine):
        # A module or an optimizer would release the parameters but leave stage 3's gradients in place.
        raise TypeError(f"abandon_step expects the engine returned by deepspeed.initialize; got "
                        f"{type(engine).__name__}")
    coordinator_of(engine, api="abandon_step").reset_step(abandoning=True)
    optimizer = engine.optimizer
    buckets = getattr(optimizer, "ipg_buckets", None)
    if buckets is None:
        return  # no ZeRO-3 optimizer (an inference engine): no gradient state to drop
    for bucket in buckets.values():
        bucket.clear_params()
    for param in engine.module.parameters():
        param.grad = None
    for param_id in getattr(optimizer, "params_already_reduced", {}):
        optimizer.params_already_reduced[param_id] = False
    # Copy, not accumulate, on the next reduction: the partial one is overwritten instead of summed.
    optimizer.micro_step_id = 0
    optimizer._epilogue_ran_this_backward = False
    # engine.backward() entered upstream's backward context and never left it; a later direct
    # loss.backward() would otherwise skip its epilogue.
    hook_state = getattr(optimizer, "_backward_hook_state", None)
    if hook_state is not None:
        hook_state.backward_active_depth = 0
        hook_state.reset_for_new_step()
