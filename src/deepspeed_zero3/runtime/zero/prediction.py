"""What a pass replays when its kind has no trace yet: a guess, checked as it runs.

[Note: first-pass prediction]
Without a guess the first pass of each kind fetches every module on demand: the
first forward and backward of a run, and the first eval forward after any
number of training steps (upstream walks its single trace there). The guesses,
in order of preference:

* forward (with or without grad): the kind's own most recent trace (not a guess);
  else the most recent trace of the other forward kind, so the first eval forward
  borrows the training forward's order and the first training forward after
  evals borrows theirs; else the module registration order: every managed
  module in ``ds_id`` order, the registry's pre-order walk that stops at z3 leaf
  modules (a leaf fetches its subtree at once, as at run time);
* backward: the backward trace that last followed the forward it follows (not a
  guess); else the reverse of that forward; with no forward to follow (one that
  raised), the most recent backward trace.

A guess keeps only the modules that fetch parameters and can run a forward of
their own, in that order, and is followed loosely ([Note: trace selection]). A
container (``nn.ModuleList``, ``nn.ModuleDict``) made a z3 leaf has no forward:
its children have no hooks (a leaf's subtree is fetched by the leaf), so their
parameters are only ever gathered by ``ZeROOrderedDict``'s getter, one at a
time, as upstream gathers them; a prefetch for that leaf would gather what no
fetch waits for ([Note: a parameter read while in flight]). A module run twice,
or in an order other than its registration (a training-only branch registered
last but run before the head), is a miss: from there the pass fetches on
demand, as a divergence from a cached trace does. A guess is a ``PredictedTrace``, which the
cache never takes: the pass records the order it observed, so the next pass of
the kind replays what really ran. Keeping for the backward ([Note: budgeted
keeping]) reads the same expected backward, so what a forward keeps is what the
backward's guess walks first.
"""

import weakref
from typing import Callable, Iterable, Optional, Sequence

from torch.nn import Module

from deepspeed_zero3.runtime.zero.module_params import fetch_params
from deepspeed_zero3.runtime.zero.stats import PassKind
from deepspeed_zero3.runtime.zero.trace import PassTrace, TraceCache

OTHER_FORWARD = {PassKind.FORWARD: PassKind.EVAL_FORWARD, PassKind.EVAL_FORWARD: PassKind.FORWARD}


def runs_a_forward(module: Module) -> bool:
    """False for a module whose class leaves ``nn.Module.forward`` unimplemented (containers): calling it raises,
    so its forward hooks never fire."""
    return type(module).forward is not Module.forward


class PredictedTrace(PassTrace):
    """A guessed module order: the modules that fetch parameters and can run a forward, in the order the guess
    expects them."""

    predicted = True

    def __init__(self, kind: PassKind, modules: Sequence[Module], source: str):
        super().__init__(kind, [m for m in modules if runs_a_forward(m) and fetch_params(m, strict=False)])
        self.source = source  # "registration", "borrowed", "reversed": for logs and tests

    def describe(self) -> str:
        return f"{self.source} guess for a {self.kind.value} pass: {len(self)} modules, {self.total_numel} numel"


class FirstPassPrediction:
    """Chooses the trace a pass starts from. Pure: depends on the cache and the module numbering only."""

    def __init__(self):
        # Set by the registry that owns the coordinator: the managed modules, in any order.
        self.managed_modules: Callable[[], Iterable[Module]] = tuple
        # A forward trace's reversed guess, made once per trace (begin_backward_pass and keeping both read it).
        self._reversed: "weakref.WeakKeyDictionary[PassTrace, PredictedTrace]" = weakref.WeakKeyDictionary()

    def forward_guess(self, kind: PassKind, cache: TraceCache) -> Optional[PassTrace]:
        own = cache.most_recent(kind)
        if own is not None:
            return own
        borrowed = cache.most_recent(OTHER_FORWARD[kind])
        if borrowed is not None:
            return PredictedTrace(kind, borrowed.live_modules(), "borrowed")
        modules = sorted((m for m in self.managed_modules() if hasattr(m, "ds_id")), key=lambda m: m.ds_id)
        guess = PredictedTrace(kind, modules, "registration")
        return guess if len(guess) else None

    def backward_guess(self, forward: Optional[PassTrace], cache: TraceCache) -> Optional[PassTrace]:
        if forward is None:
            return cache.most_recent(PassKind.BACKWARD)
        return self.expected_backward(forward)

    def expected_backward(self, forward: PassTrace) -> Optional[PassTrace]:
        """The backward expected after ``forward``: the one that last followed it, else its reverse."""
        if forward.next_backward is not None:
            return forward.next_backward
        guess = self._reversed.get(forward)
        if guess is None:
            guess = PredictedTrace(PassKind.BACKWARD, list(reversed(forward.live_modules())), "reversed")
            self._reversed[forward] = guess
        return guess if len(guess) else None

    def backward_to_keep_for(self, forward: PassTrace, nth_forward: int) -> Optional[PassTrace]:
        """The backward that the ``nth_forward``-th forward with grad since the last backward, replaying
        ``forward``, keeps parameters for: the expected one if a backward came after as many forwards the last
        time, else none ([Note: budgeted keeping])."""
        return self.expected_backward(forward) if nth_forward == forward.forwards_per_backward else None

    def clear(self) -> None:
        self._reversed.clear()
