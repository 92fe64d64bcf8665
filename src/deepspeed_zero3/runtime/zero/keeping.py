"""What a forward with grad leaves gathered for its backward.

[Note: budgeted keeping]
A parameter released after its last forward use and gathered again in the
backward costs a second all-gather; one kept gathered costs memory from its
last forward use until its first backward use. The backward runs the forward
roughly in reverse, so the tail of the forward is needed first and held for the
shortest time. The rule:

* Walk the backward the forward expects (the backward trace that last followed
  it, else the reversed guess, [Note: first-pass prediction]) from its start
  and keep each parameter the forward uses while the numel kept so far fits in
  ``stage3_max_live_parameters - stage3_prefetch_bucket_size`` and its reuse
  distance (numel fetched after its last forward use up to its first backward
  use) is under the larger of ``stage3_max_reuse_distance`` and one prefetch
  bucket. The walk stops at the first parameter that does not qualify, so what
  is kept is always a tail of the forward: the backward's first modules.
* Why one bucket even at reuse 0, which asks for the least memory: a parameter
  back within one bucket is one the backward's first prefetch window gathers
  again the moment the backward starts. Releasing it saves no memory at the
  backward's start and costs a second gather of it, plus a wait on the other
  ranks between the two passes. Kept parameters all lie in the forward's last
  bucket (plus the module that crosses into it), so the forward's peak, module
  in use + window, grows by at most one module; Model A at reuse 0 keeps head +
  the last down projection (263,428 of 6,312,196), the backward's peak grows by
  the head (1,028) and a step gathers 1.96x instead of 2.00x. A model smaller
  than one bucket is kept whole, as upstream keeps it (its prefetcher, scanning
  one trace across both passes, keeps what it has already fetched for the
  backward): the forward's first window held all of it anyway.
* Reserving one bucket keeps both prefetch windows whole: in the forward, live =
  kept so far + the module in use + the window, and kept so far + the module in
  use (itself kept, or not yet into the tail) stays under cap - bucket; in the
  backward, which starts with exactly the kept numel live, the first window
  fits at once, and live only falls as kept parameters are used and released.
  Neither window is cut by the cap, so nothing is fetched on demand, and the
  peak is at most cap + one bucket + the largest module (the one that crosses
  the bucket line).
* Keeping is for a backward that comes. A forward starts by releasing what an
  earlier one kept, so only the last forward with grad before a backward keeps
  usefully. Each forward trace remembers how many forwards with grad the step
  of the backward that last followed it ran (1 until one has): the n-th forward
  since the last backward keeps only if n is that number. Forwards that no
  backward follows (scoring with grad enabled; upstream's own
  ``TestZeroPartitionCache`` runs three forwards and then expects every
  parameter released) keep at the first only, and two forwards before one
  backward (a loss over both) keep at the second once a step has shown it.
  ``abandon_step`` ends the count as a backward would (without recording it):
  the forward after an abandoned one is the first of its step again.
  Upstream releases in the first case too: its trace of such a step holds no
  backward use to reuse.
* A parameter is kept only at its last use in the forward (an earlier release
  of a parameter used twice follows the in-pass reuse distance), so kept memory
  grows only through the tail.

Gathered per training step is then 2 - kept/model. With the default cap and
reuse distance (1e9 each) a model under 1e9 parameters is kept whole (1.00x),
as before. Model A, bucket 100,000, default reuse (``bench --frontier``,
``tests/distributed/test_keeping.py``): at caps of 50% / 25% / 10% of the model
a forward keeps 45.8% / 20.8% / 8.3%, the peak is 50.0% / 25.0% / 12.5%, and a
step gathers 1.54x / 1.79x / 1.92x with nothing on demand. Upstream at reuse 0
reaches 54% / 29% / 12.5% peak for 1.58x / 1.75x / 1.92x, and at the default
reuse distance ignores the cap (100%, plus 3.2M / 4.7M / 5.5M numel on demand
per step). Keeping by the cap at reuse 0 as well would have made reuse 0 with
the default cap the 100% / 1.00x point, the same as the default reuse distance,
and left no setting for the least-memory one (8.3%, 1.96x).

The plan depends on the traces and the settings only, the same on every rank
([Note: trace selection]).
"""

from typing import FrozenSet, Optional

from torch.nn import Parameter

from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.trace import PassTrace


def plan_kept(forward: PassTrace, backward: Optional[PassTrace], settings: PrefetchSettings) -> FrozenSet[Parameter]:
    """The parameters a forward following ``forward`` keeps for ``backward`` ([Note: budgeted keeping])."""
    limit = max(settings.max_reuse_numel, settings.bucket_numel)
    room = settings.max_live_numel - settings.bucket_numel
    if backward is None or room <= 0:
        return frozenset()
    kept = set()
    kept_numel = 0
    forward_len = len(forward)
    for param, step in backward.param_uses:
        if param in kept or param.ds_persist:
            continue
        last = forward.last_use(param)
        if last is None:
            continue  # used in the backward only (recomputation): nothing to keep
        distance = forward.numel_between(last + 1, forward_len) + backward.numel_between(0, step)
        if distance >= limit or kept_numel + param.ds_numel > room:
            break
        kept.add(param)
        kept_numel += param.ds_numel
    return frozenset(kept)


class BackwardKeeping:
    """The keep plan of the running forward, made once per (forward trace, expected backward, settings)."""

    def __init__(self):
        self._key = None
        self._kept: FrozenSet[Parameter] = frozenset()
        self._traces = None

    def kept(self, forward: PassTrace, backward: Optional[PassTrace],
             settings: PrefetchSettings) -> FrozenSet[Parameter]:
        key = (id(forward), id(backward), settings)
        if key != self._key:
            self._kept = plan_kept(forward, backward, settings)
            self._key = key
            self._traces = (forward, backward)  # the ids in the key stay valid while the plan is cached
        return self._kept

    def keeps(self, param: Parameter, step: int, forward: PassTrace, backward: Optional[PassTrace],
              settings: PrefetchSettings) -> bool:
        """Whether releasing ``param`` after ``step`` of ``forward`` keeps it for the backward instead."""
        if forward.next_use(param, step) is not None:
            return False  # not its last forward use
        return param in self.kept(forward, backward, settings)

    def clear(self) -> None:
        self._key = None
        self._kept = frozenset()
        self._traces = None
