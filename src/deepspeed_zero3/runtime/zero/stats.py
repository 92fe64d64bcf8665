"""Per-pass counters of the ZeRO-3 parameter runtime.

Every number here is a count, not a timing, so it repeats exactly from run to
run and tests assert it exactly. The counters are updated by the coordinator
as it gathers and releases; nothing here issues a collective.
"""

import collections
from dataclasses import asdict, dataclass, field
from typing import Deque, Dict, Optional

from deepspeed import comm as dist

from deepspeed_zero3.runtime.zero.passes import PassKind


@dataclass
class PassStats:
    kind: str
    index: int  # the how-many-th pass of this runtime this was
    allgather_calls: int = 0
    allgather_numel: int = 0
    demand_numel: int = 0  # gathered when the module needed it: not prefetched in time
    prefetch_numel: int = 0  # gathered ahead of use by a prefetcher
    peak_live_numel: int = 0  # gathered non-persistent numel, maximum over the pass
    trace_records: int = 0  # 1 when this pass recorded a new trace
    trace_mismatches: int = 0  # 1 when this pass left the trace it replayed with no cached trace to switch to
    trace_switches: int = 0  # times this pass moved to another cached trace that matched what ran
    aborted: bool = False  # the pass ended without its closing hook (exception, abandoned step)
    # NVMe parameter offload ([Note: NVMe swap-in ahead] in nvme_swap.py), in partitions:
    swap_in_ahead: int = 0  # read from NVMe ahead of their gather, asynchronously
    swap_in_demand: int = 0  # read synchronously by the gather of the module that needed them
    swap_in_unused: int = 0  # read ahead and given back unused at the end of the pass
    # 1 when the ranks compared this pass before its first all-gather ([Note: ranks in different passes]): one
    # collective of 3 integers, not counted in allgather_calls
    pass_checks: int = 0

    def as_dict(self):
        return asdict(self)

    def on_allgather(self, numel: int, prefetch: bool) -> None:
        self.allgather_calls += 1
        self.allgather_numel += numel
        if prefetch:
            self.prefetch_numel += numel
        else:
            self.demand_numel += numel

    def note_live(self, live_numel: int) -> None:
        if live_numel > self.peak_live_numel:
            self.peak_live_numel = live_numel


@dataclass
class KindTotals:
    passes: int = 0
    allgather_calls: int = 0
    allgather_numel: int = 0
    demand_numel: int = 0
    prefetch_numel: int = 0
    peak_live_numel: int = 0
    trace_records: int = 0
    trace_mismatches: int = 0
    trace_switches: int = 0
    swap_in_ahead: int = 0
    swap_in_demand: int = 0
    swap_in_unused: int = 0
    pass_checks: int = 0

    def add(self, stats: PassStats):
        self.passes += 1
        self.allgather_calls += stats.allgather_calls
        self.allgather_numel += stats.allgather_numel
        self.demand_numel += stats.demand_numel
        self.prefetch_numel += stats.prefetch_numel
        self.peak_live_numel = max(self.peak_live_numel, stats.peak_live_numel)
        self.trace_records += stats.trace_records
        self.trace_mismatches += stats.trace_mismatches
        self.trace_switches += stats.trace_switches
        self.swap_in_ahead += stats.swap_in_ahead
        self.swap_in_demand += stats.swap_in_demand
        self.swap_in_unused += stats.swap_in_unused
        self.pass_checks += stats.pass_checks


@dataclass
class ZeroStats:
    """Counters for one parameter-state registry (one managed model). The running pass holds its own
    ``PassStats`` ([Note: the running pass]); every method that counts into it is given it."""
    history_len: int = 64
    live_numel: int = 0
    passes_started: int = 0
    history: Deque[PassStats] = field(default_factory=collections.deque)
    totals: Dict[str, KindTotals] = field(default_factory=dict)
    # gathers that happen while no pass runs (a getter read or a fetch between passes)
    outside_pass: PassStats = field(default_factory=lambda: PassStats(kind="outside_pass", index=-1))

    def begin_pass(self, kind: PassKind) -> PassStats:
        """A new pass's counters, for the pass to hold."""
        stats = PassStats(kind=kind.value, index=self.passes_started, peak_live_numel=self.live_numel)
        self.passes_started += 1
        return stats

    def end_pass(self, finished: PassStats, aborted: bool = False) -> PassStats:
        finished.aborted = aborted
        self.history.append(finished)
        while len(self.history) > self.history_len:
            self.history.popleft()
        self.totals.setdefault(finished.kind, KindTotals()).add(finished)
        return finished

    def on_live_change(self, delta: int, counting: PassStats) -> None:
        """The gathered numel moved by ``delta``; ``counting`` (the running pass's counters, or
        ``outside_pass``) keeps the peak."""
        self.live_numel += delta
        counting.note_live(self.live_numel)

    def reset(self, running: Optional[PassStats] = None) -> None:
        """Forget the counted passes; ``running`` (the running pass's counters) starts again from now."""
        self.history.clear()
        self.totals.clear()
        self.outside_pass = PassStats(kind="outside_pass", index=-1)
        if running is not None:
            # In place: the running pass holds this object and goes on counting into it.
            fresh = PassStats(kind=running.kind, index=running.index, peak_live_numel=self.live_numel)
            vars(running).update(vars(fresh))

    def last(self, kind: str) -> Optional[PassStats]:
        for stats in reversed(self.history):
            if stats.kind == kind:
                return stats
        return None

    def snapshot(self) -> dict:
        return {
            "live_numel": self.live_numel,
            "passes": [s.as_dict() for s in self.history],
            "totals": {kind: asdict(t) for kind, t in self.totals.items()},
            "outside_pass": self.outside_pass.as_dict(),
        }


STATS_EVERY_ENV = "DEEPSPEED_ZERO3_STATS_EVERY"


def stats_every_from_env(environ) -> int:
    """Print one stats line every N backward passes when DEEPSPEED_ZERO3_STATS_EVERY=N (0 or unset: never)."""
    raw = environ.get(STATS_EVERY_ENV, "").strip()
    if not raw:
        return 0
    try:
        every = int(raw)
    except ValueError:
        every = -1
    if every < 0:
        raise ValueError(f"{STATS_EVERY_ENV}={raw!r} is not allowed: expected a whole number of backward "
                         f"passes >= 0 (0 turns the stats line off)")
    return every


def print_line_if_due(stats: ZeroStats, backward_passes: int, every: int) -> None:
    """Print ``format_line`` on rank 0 when ``backward_passes`` is a multiple of ``every`` (0: never). Asked for by
    name, so printed: deepspeed's logger shows only warnings by default."""
    if every and backward_passes % every == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
        print(format_line(stats, backward_passes), flush=True)


def format_line(stats: ZeroStats, backward_passes: int) -> str:
    """One line: the last pass of each kind, numel in millions, after ``backward_passes`` backward passes."""
    parts = []
    for kind in PassKind:
        last = stats.last(kind.value)
        if last is None:
            continue
        parts.append(f"{kind.value}: {last.allgather_calls} gathers {last.allgather_numel / 1e6:.3f}M "
                     f"demand {last.demand_numel / 1e6:.3f}M peak-live {last.peak_live_numel / 1e6:.3f}M "
                     f"records {last.trace_records}")
    return f"deepspeed-zero3 stats after backward {backward_passes} | " + " | ".join(parts)
