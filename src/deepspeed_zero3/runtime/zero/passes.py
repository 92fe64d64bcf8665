"""The kinds of pass the runtime tells apart, and where a pass ends.

[Note: the end of a backward]
A backward pass ends when the autograd graph task that began it completes: a callback queued on
that task at the pass's first backward hook closes it, releasing what the backward still holds
(modules whose post-backward never fired), recording its trace and checking the ranks' order.
That is the one place, on every supported release: stage 3 calls ``release_backward_leftovers``
after ``engine.backward()`` only from 0.19.3, and a direct ``loss.backward()`` never does, so
waiting for it would leave the leftovers gathered until the next forward or ``step()``. A graph
task that raises runs no callback: its pass stays open and the next boundary closes it as aborted
([Note: a backward that raised]). ``release_backward_leftovers`` then finds no backward running.
The callback runs before stage 3's own end-of-backward callbacks, which were queued later; they
reduce gradients and read no parameter.

[Note: silent passes]
A forward that gathered nothing and released nothing found every parameter gathered and left it
so: inside ``GatheredParameters`` over the model (whose parameters are never released under it),
all persistent, or all kept from the last eval forward. The first is the one way a forward may
run on one rank alone, so such a pass leaves the runtime as it found it: no trace recorded or
moved to the front, no order check, no external read committed, no count toward the next
backward, nothing released at its end. Each would make this rank's next collectives differ from
the other ranks'.
"""

import enum

# Logged when the next boundary finds a backward still open that its graph task's completion did not close.
BACKWARD_RAISED = ("deepspeed-zero3: a backward pass raised before it finished; the parameters it gathered are now "
                   "released and its partial module order is not kept as a trace. Stage 3 still holds that backward's "
                   "partial gradients: call deepspeed_zero3.abandon_step(engine) after catching the exception to drop "
                   "them.")


class PassKind(enum.Enum):
    """What kind of pass is running, decided by grad mode and autograd, never by ``nn.Module.training``."""
    FORWARD = "forward"  # forward with grad enabled: a backward may follow
    EVAL_FORWARD = "eval_forward"  # forward with grad disabled
    BACKWARD = "backward"  # everything the autograd engine runs, recomputation included

    @property
    def role(self) -> str:
        """``"forward"`` or ``"backward"``: which of the two prefetchers a pass of this kind has."""
        return "backward" if self is PassKind.BACKWARD else "forward"
