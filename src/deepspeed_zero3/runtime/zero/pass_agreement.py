"""The ranks agree on which pass they are in before its first all-gather.

[Note: ranks in different passes]
``generate()`` with ``synced_gpus=False`` lets each rank stop at its own token. Under a live cap
every token gathers, so a rank that left generation runs its next pass (a training forward)
while another still decodes, and their parameter all-gathers pair across the two passes:
unequal sizes crash, equal ones (identical layers) hand each rank the other pass's shards. The
module-order check ([Note: diverging ranks]) runs after a backward: too late for that.
* Rule: before a pass issues its first parameter all-gather, the ranks exchange (kind, number of
  gathering passes so far) in one all_gather of 3 integers over the data-parallel group; if they
  differ, every rank raises, naming each rank's pass, before any parameter gather is paired.
* Only gathering passes take part. A pass that gathers nothing (a decode token with the model
  kept, a forward inside ``GatheredParameters``) issues no collective and counts on no rank, so
  ranks that stop generating at different tokens at the default keys go on as before.
* Both ranks' numbers go up when they disagree, so after the error (``abandon_step``, or a new
  step on every rank) the next gathering passes agree again.
* Its exchange has the width of the order check's and a tag the order check's cannot have, so
  either one meeting the other raises on every rank instead of pairing mismatched collectives.
* One all_gather and one device-to-host copy per gathering pass (a decode token under a cap pays
  it). ``DEEPSPEED_ZERO3_PASS_AGREEMENT=0`` turns it off.
"""

from typing import List

from deepspeed import comm as dist

from deepspeed_zero3.runtime.zero.passes import PassKind
from deepspeed_zero3.runtime.zero.rank_agreement import (AGREEMENT_TAG, distributed, exchange, group_ranks,
                                                         switch_from_env)

PASS_AGREEMENT_ENV = "DEEPSPEED_ZERO3_PASS_AGREEMENT"
_KIND_CODES = {kind: index for index, kind in enumerate(PassKind)}
ADVICE = ("A rank left a loop of passes (generate() stopping at its own end-of-sequence token, or any "
          "data-dependent loop) before the others. Pass synced_gpus=True to generate(), or stop every rank at "
          "the same token. No parameter all-gather of this pass was issued: catch the error on every rank, then "
          "call deepspeed_zero3.abandon_step(engine) or start the next step on every rank.")


def pass_agreement_from_env(environ) -> bool:
    return switch_from_env(environ, PASS_AGREEMENT_ENV, True,
                           "use 1 (default) to have the ranks agree on the pass before its first all-gather, or 0 "
                           "to skip that check")


class RanksInDifferentPasses(RuntimeError):
    """The ranks reached a pass's first all-gather in different passes ([Note: ranks in different passes])."""


class PassAgreement:
    """[Note: ranks in different passes]: the count of gathering passes, and the exchange that compares it."""

    def __init__(self, group=None, enabled: bool = True):
        self.group = group  # the ranks that gather together (None: the world)
        self.enabled = enabled
        self.passes = 0  # gathering passes so far on this rank, agreed or not

    def applies(self) -> bool:
        """Whether ``agree`` exchanges anything: on, and another rank to compare with."""
        return self.enabled and distributed(self.group)

    def agree(self, kind: PassKind) -> None:
        """Compare this pass with every rank's (one collective, where ``applies()``); raise on every rank if they
        differ."""
        if not self.applies():
            return
        number = self.passes
        self.passes += 1
        seen = exchange([AGREEMENT_TAG, _KIND_CODES[kind], number], self.group)
        if any(entry != seen[0] for entry in seen):
            raise RanksInDifferentPasses(self.describe(kind, number, seen, dist.get_rank()))

    def describe(self, kind: PassKind, number: int, seen: List[List[int]], rank: int) -> str:
        """The error ``rank`` raises: its pass, then every rank's, from what each one sent."""
        ranks = group_ranks(self.group, len(seen))
        kinds = list(PassKind)
        parts = []
        for member, (tag, code, other) in zip(ranks, seen):
            if tag != AGREEMENT_TAG:
                parts.append(f"rank {member}: ending a pass (comparing module orders)")
            else:
                parts.append(f"rank {member}: {kinds[code].value} pass, gathering pass {other}")
        return (f"deepspeed-zero3: ranks are in different passes at their next parameter all-gather; this rank "
                f"(rank {rank}) is in a {kind.value} pass, gathering pass {number}; "
                + "; ".join(parts) + f". {ADVICE}")
