"""``deepspeed_zero3.abandon_step(engine)``: drop a failed step, so training goes on as if it never ran.

[Note: a backward that raised]
An exception inside backward stops the autograd engine half way, unseen by our hooks. The
coordinator learns it at the next pass boundary, because the graph task that began the backward
never ran the callback queued at its start, which closes a finished backward: it releases what
was gathered and records no trace of the partial order. Upstream's stage 3 optimizer does not
recover: gradients that reached its reduce bucket stay there (``.grad`` aliasing the bucket), and
its next backward fails a duplicate-parameter assertion (with DEEPSPEED_ZERO3=0 too).
``abandon_step`` empties that bucket as stage 3's own ``clear_params()`` does (each release's bucket,
[Note: release capabilities]), drops the module's
``.grad`` and restarts gradient accumulation: a partially reduced backward cannot be subtracted.
"""

from deepspeed.runtime.engine import DeepSpeedEngine

from deepspeed_zero3.runtime.zero import capabilities
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
    if not capabilities.clear_reduce_bucket(optimizer):
        return  # no ZeRO-3 optimizer (an inference engine): no gradient state to drop
    for param in engine.module.parameters():
        param.grad = None
    for param_id in getattr(optimizer, "params_already_reduced", {}):
        optimizer.params_already_reduced[param_id] = False
    # Copy, not accumulate, on the next reduction: the partial one is overwritten instead of summed.
    optimizer.micro_step_id = 0
    optimizer._epilogue_ran_this_backward = False
    # engine.backward() entered upstream's backward context and never left it; a later direct
    # loss.backward() would otherwise skip its epilogue.
    capabilities.leave_backward_context(optimizer)
