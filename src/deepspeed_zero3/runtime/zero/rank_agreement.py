"""Checking that every rank runs the same modules in the same order.

[Note: diverging ranks]
Every fetch is a collective, so every rank must fetch the same modules in the same order. Where
they do not, equal-sized all-gathers pair up and mix the wrong shards, unequal ones fail or hang.
* Always (``PassOrderCheck``): the ranks compare one fingerprint of the module orders of the
  passes run since the last check (one all_gather of 3 integers, one device-to-host copy) at the
  end of every backward, where the ranks wait for gradients anyway, and after MAX_PENDING_PASSES
  passes without one: no-grad forwards and generated tokens cost nothing of their own. On a
  mismatch every rank raises, naming each rank's pass, step and module, before the optimizer
  step. Passes no check follows (the tail of an inference-only run) are not compared: a check in
  ``destroy()`` would be a collective one rank may reach alone. Silent and aborted passes are
  counted on no rank, so the batches line up.
* ``DEEPSPEED_ZERO3_CHECK_RANKS=1``: one all_gather of 2 integers before every fetch, so the
  ranks stop before any mismatched all-gather: a debug mode.
The tensors live on the accelerator's current device: NCCL has no CPU tensors.
"""

import zlib
from array import array
from typing import Dict, List, Sequence, Tuple

import torch
from torch.nn import Module

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator

from deepspeed_zero3.runtime.zero.passes import PassKind

CHECK_RANKS_ENV = "DEEPSPEED_ZERO3_CHECK_RANKS"
AGREEMENT_ADVICE = ("ZeRO-3 needs every rank to run the same modules in the same order; make data-dependent "
                    "control flow agree across ranks (decide it on one rank and broadcast it).")
# Passes compared in one batch at most when no backward comes: the delay before a divergence in eval or
# generation forwards is detected, and one check's cost spread over that many passes.
MAX_PENDING_PASSES = 32
_KIND_CODES = {kind: -10 - index for index, kind in enumerate(PassKind)}
# The first of the three integers a pass agreement exchanges ([Note: ranks in different passes]): an order check's
# is a pass count (>= 0), so a rank in either exchange can tell that another rank is in the other one.
AGREEMENT_TAG = -7_000_001
_KINDS_BY_CODE = {code: kind for kind, code in _KIND_CODES.items()}


def switch_from_env(environ, name: str, default: bool, meaning: str) -> bool:
    """One of our on/off environment variables: 1, true, on, yes or 0, false, off, no (any case; unset or empty:
    ``default``). Anything else is a ValueError naming the variable, the value and ``meaning`` (what is allowed)."""
    raw = environ.get(name, "").strip().lower()
    if raw == "":
        return default
    if raw in ("1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{name}={raw!r} is not allowed: {meaning}")


def check_ranks_from_env(environ) -> bool:
    return switch_from_env(environ, CHECK_RANKS_ENV, False,
                           f"use 1 to check the module order across ranks before every fetch, or 0 (default) to "
                           f"check it after every backward pass and every {MAX_PENDING_PASSES} passes without one")


def distributed(group=None) -> bool:
    """Whether there is anyone to compare with in ``group`` (None: the whole world)."""
    return dist.is_initialized() and dist.get_world_size(group=group) > 1


def group_ranks(group, size: int) -> List[int]:
    """Global ranks of the members of ``group``, in group order (for messages)."""
    return list(range(size)) if group is None else list(dist.get_all_ranks_from_group(group))


def exchange(values: Sequence[int], group=None) -> List[List[int]]:
    """Every rank's ``values`` (the same length on every rank), in group rank order."""
    mine = torch.tensor(list(values), dtype=torch.long, device=get_accelerator().current_device_name())
    everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(everyone, mine, group=group)
    # One device-to-host copy (one sync on GPUs), not one per rank.
    return torch.stack(everyone).cpu().tolist()


def exchange_ragged(values: Sequence[int], group=None) -> List[List[int]]:
    """Every rank's ``values``, of any length: lengths first, then the lists padded with -1."""
    lengths = [entry[0] for entry in exchange([len(values)], group)]
    padded = list(values) + [-1] * (max(lengths) - len(values))
    return [row[:length] for row, length in zip(exchange(padded, group), lengths)]


def check_same_module_on_all_ranks(kind: PassKind, step: int, module: Module, group=None) -> None:
    """Debug mode: raise on every rank before the fetch if the ranks are about to fetch different modules."""
    if not distributed(group):
        return
    seen = [tuple(entry) for entry in exchange([step, module.ds_id], group)]
    if any(entry != seen[0] for entry in seen):
        ranks = group_ranks(group, len(seen))
        listing = ", ".join(f"rank {r}: step {st} module ds_id={mid}" for r, (st, mid) in zip(ranks, seen))
        raise RuntimeError(f"deepspeed-zero3 ({CHECK_RANKS_ENV}=1): ranks diverged in a {kind.value} pass; this rank "
                           f"(rank {dist.get_rank()}) is at step {step} in module {type(module).__name__} "
                           f"ds_id={module.ds_id}; {listing}. No mismatched all-gather was issued. "
                           f"{AGREEMENT_ADVICE}")


class PassOrderCheck:
    """The module orders of the passes run since the last cross-rank check, and the check itself."""

    def __init__(self, group=None):
        # The ranks that gather together: the engine's data-parallel group (None: the world).
        self.group = group
        # (pass number, kind, ds_ids, module classes): the ds_ids list is the pass's own, kept, not copied. Classes,
        # not modules: no-grad passes wait here for up to MAX_PENDING_PASSES passes, and a module would keep
        # alive whatever holds it (a dropped engine's wrapper and, through its hooks, the engine); a class only
        # names a module in an error.
        self.pending: List[Tuple[int, PassKind, Sequence[int], Tuple[type, ...]]] = []

    def add(self, number: int, kind: PassKind, ids: Sequence[int], modules: Sequence[Module]) -> None:
        self.pending.append((number, kind, ids, tuple(type(m) for m in modules)))

    def due(self, kind: PassKind) -> bool:
        """Check after a backward (where the runtime stops anyway), and after MAX_PENDING_PASSES passes that
        no backward followed: eval forwards and generated tokens are compared in batches, with bounded memory
        for the pending orders ([Note: diverging ranks])."""
        return kind is PassKind.BACKWARD or len(self.pending) >= MAX_PENDING_PASSES

    def flat(self) -> List[int]:
        """The pending orders as one sequence: a kind marker, then that pass's ds_ids."""
        out: List[int] = []
        for _, kind, ids, _ in self.pending:
            out.append(_KIND_CODES[kind])
            out.extend(ids)
        return out

    def check(self) -> None:
        """Compare the pending orders across ranks (one all_gather of 3 integers); raise on every rank if they differ."""
        if not distributed(self.group):
            self.pending = []
            return
        flat = self.flat()
        pending, self.pending = self.pending, []
        data = array("q", flat).tobytes()
        # crc32 and adler32 in one int64 (shifted into its signed range).
        digest = ((zlib.crc32(data) << 32) | zlib.adler32(data)) - (1 << 63)
        fingerprints = exchange([len(pending), len(flat), digest], self.group)
        if all(entry == fingerprints[0] for entry in fingerprints):
            return
        if any(entry[0] == AGREEMENT_TAG for entry in fingerprints):
            # Another rank is starting a pass's first all-gather: no second exchange, it would not be paired.
            ranks = group_ranks(self.group, len(fingerprints))
            starting = [str(rank) for rank, entry in zip(ranks, fingerprints) if entry[0] == AGREEMENT_TAG]
            raise RuntimeError(f"deepspeed-zero3: ranks are in different passes: rank {dist.get_rank()} is ending a "
                               f"pass and comparing module orders while rank(s) {', '.join(starting)} began the "
                               f"next pass's first all-gather ([Note: ranks in different passes]). A rank left a "
                               f"loop of passes (generate() stopping at its own end-of-sequence token) before the "
                               f"others: pass synced_gpus=True to generate(), or stop every rank at the same token.")
        orders = exchange_ragged(flat, self.group)
        if any(order != orders[0] for order in orders):  # else a fingerprint collision: the orders agree
            raise RuntimeError(self.describe(pending, orders))

    def describe(self, pending, orders: List[List[int]]) -> str:
        reference = orders[0]
        differing = next(r for r, order in enumerate(orders) if order != reference)
        other = orders[differing]
        position = next((i for i, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference),
                                                                                            len(other)))
        # Modules are named from what this rank ran in the window (ds_ids are the same on every rank).
        names = {ds_id: cls.__name__ for _, _, ids, classes in pending for ds_id, cls in zip(ids, classes)}
        ranks = group_ranks(self.group, len(orders))
        parts = [f"rank {ranks[i]}: {where(orders[i], position, names)}" for i in (0, differing)]
        covered = f"passes {pending[0][0]}..{pending[-1][0]}" if pending else "no pass on this rank"
        return (f"deepspeed-zero3: ranks ran different modules (checked after pass "
                f"{pending[-1][0] if pending else '-'}, covering {covered}): " + "; ".join(parts) +
                f". Parameters gathered since that point may have paired different shards across ranks; this "
                f"step must not be applied. {AGREEMENT_ADVICE} Set {CHECK_RANKS_ENV}=1 to stop before the "
                f"first mismatched all-gather instead.")


def where(order: List[int], position: int, names: Dict[int, str]) -> str:
    """'<kind> pass, step <s>, module <type> ds_id=<id>' for the entry at ``position`` of a flat order."""
    kind, step = None, -1
    for value in order[:position + 1]:
        if value in _KINDS_BY_CODE:
            kind, step = _KINDS_BY_CODE[value], -1
        else:
            step += 1
    if position >= len(order):
        return f"{kind.value if kind else 'no'} pass, ended before step {step + 1}"
    value = order[position]
    if value in _KINDS_BY_CODE:
        return f"began a {_KINDS_BY_CODE[value].value} pass at this point"
    return f"{kind.value} pass, step {step}, module {names.get(value, 'module')} ds_id={value}"
