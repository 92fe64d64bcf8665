"""Ending a weight stream on every rank when one rank's consumer stops.

[Note: a stream stops together]
Each bucket is a collective, so a rank whose consumer raises (a full disk, a dead receiver) or
breaks out alone would leave the others issuing all-gathers it never joins: a hang until the
process-group timeout. So after every bucket each rank says whether it goes on (one all_reduce of
one integer in the ranks that gather together), before any later bucket is issued:
* all go on: the next bucket; all stop (a ``break`` on every rank): a quiet end;
* some stop: one all_gather_object of each rank's last parameter and reason, then the ranks that
  went on raise a RuntimeError naming the rank, its parameter and its error, and the stopped ones
  keep their own exception. Either way the bucket already in flight completes and is released.
The check costs one small collective per bucket (docs/benchmarks.md, the export section); a stream
that ends by itself adds no other.
"""

from typing import Optional

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator


class StreamLockstep:
    """The per-bucket agreement of one stream over ``group`` (None: the world)."""

    def __init__(self, group=None):
        self.group = group
        self.enabled = dist.is_initialized() and dist.get_world_size(group=group) > 1
        self.checks = 0  # agreements made (the cost, counted)

    def went_on(self, last_name: str) -> None:
        """This rank handled its bucket; raise if another rank stopped."""
        stopped = self._count(0)
        if stopped:
            reports = self._reports(None)
            raise RuntimeError(_message(reports, last_name))

    def stopped(self, last_name: str, error: Optional[BaseException]) -> bool:
        """This rank stops after ``last_name`` (``error``: why; None for a plain ``break``). True when every rank
        stopped here together (nothing to report)."""
        stopped = self._count(1)
        if self.enabled and stopped < dist.get_world_size(group=self.group):
            self._reports((last_name, "" if error is None else f"{type(error).__name__}: {error}"))
            return False
        return True

    def _count(self, mine: int) -> int:
        if not self.enabled:
            return mine
        self.checks += 1
        flag = torch.tensor([mine], dtype=torch.int32, device=get_accelerator().current_device_name())
        dist.all_reduce(flag, group=self.group)
        return int(flag.item())

    def _reports(self, mine):
        reports = [None] * dist.get_world_size(group=self.group)
        # torch's own: deepspeed.comm has no all_gather_object on some supported releases (0.16.0).
        torch.distributed.all_gather_object(reports, (dist.get_rank(), mine), group=self.group)
        return reports


def _message(reports, last_name: str) -> str:
    stopped = [(rank, report) for rank, report in reports if report is not None]
    parts = [f"rank {rank} after {name!r}" + (f" ({reason})" if reason else " (its loop left early)")
             for rank, (name, reason) in stopped]
    return (f"deepspeed-zero3: the weight stream stopped on {', '.join(parts)}; every rank stops with it here (this "
            f"rank had handled up to {last_name!r}), since each bucket is a collective all ranks must join")
