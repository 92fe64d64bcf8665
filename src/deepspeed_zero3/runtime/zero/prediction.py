"""The trace each pass starts from; for a pass kind with no trace yet, a guess checked as it runs.

[Note: first-pass prediction]
Without a guess the first pass of each kind fetches every module on demand. Preference order:
* forward (with or without grad): its kind's most recent trace; else the other forward kind's
  (the first eval forward borrows the training order, and the reverse); else the module
  registration order (``ds_id`` order, stopping at z3 leaves as numbering does);
* backward: the backward that last followed the forward it follows; else that forward reversed;
  with no forward to follow (one that raised), the most recent backward trace.
A guess (``PredictedTrace``) lists the modules that gather something (a parameter that is not
persistent) and can run a forward (a z3 leaf container never runs: its children's parameters are
read through the getter), is followed loosely ([Note: trace selection]): a module that gathers
nothing (a LayerNorm under the persistence threshold) may run anywhere, and is never cached: the
pass records what it observed.
Invariant: every input is rank-symmetric (traces, ``ds_id`` numbering), so are the guesses.
Keeping for the backward ([Note: budgeted keeping]) reads the same expected backward.
"""

import weakref
from typing import Callable, Iterable, Optional, Sequence

from torch.nn import Module

from deepspeed_zero3.runtime.zero.module_params import gathers_anything
from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.trace import PassTrace, TraceCache

OTHER_FORWARD = {PassKind.FORWARD: PassKind.EVAL_FORWARD, PassKind.EVAL_FORWARD: PassKind.FORWARD}


def runs_a_forward(module: Module) -> bool:
    """False for a module whose class leaves ``nn.Module.forward`` unimplemented (containers): calling it raises,
    so its forward hooks never fire."""
    return type(module).forward is not Module.forward


class PredictedTrace(PassTrace):
    """A guessed module order: the modules that gather something and can run a forward, in the order the guess
    expects them."""

    predicted = True

    def __init__(self, kind: PassKind, modules: Sequence[Module], source: str):
        super().__init__(kind, [m for m in modules if runs_a_forward(m) and gathers_anything(m)])
        self.source = source  # "registration", "borrowed", "reversed": for logs and tests

    def describe(self) -> str:
        return f"{self.source} guess for a {self.kind.value} pass: {len(self)} modules, {self.total_numel} numel"


class PassPrediction:
    """Chooses the trace every pass starts from: a cached one, or a guess ([Note: first-pass prediction]).

    Its answers depend on the trace cache, the links between traces and the module numbering; it remembers
    one reversed guess per forward trace."""

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

    def clear(self) -> None:
        self._reversed.clear()
