"""Fetch and release of a submodule's partitioned parameters (served as upstream's
``deepspeed.runtime.zero.partitioned_param_coordinator``).

What differs from upstream, in one place:

* Passes, not steps. A forward pass runs from the root module's pre-forward hook to its
  forward hook; a backward pass from the first backward hook to the completion of
  its autograd graph task ([Note: the end of a backward]). Each follows its own trace (``trace.py``) with its own
  prefetcher (``prefetch.py``), so prefetching never crosses from forward into backward
  ([Note: one prefetcher per pass]). The running pass is one object ([Note: the running pass]).
* The pass kind comes from grad mode and from whether the autograd engine is running,
  never from ``nn.Module.training``; nothing here asserts on it.
* Traces are cached per pass kind and selected by what runs ([Note: trace selection]);
  a kind with no trace yet replays a guess ([Note: first-pass prediction]).
* Gathered memory is bounded by the config ([Note: the prefetch window]); a forward keeps
  the backward's first parameters within the cap less one bucket ([Note: budgeted keeping]),
  an eval forward the next eval forward's within the cap ([Note: keeping across no-grad passes]).
* One coordinator per managed module tree, shared by every engine over it (``param_registry.py``).
* Counters for tests and benchmarks (``stats.py``).
* Upstream's module-level names are re-exported from ``upstream_names.py``
  ([Note: upstream's module names]).
"""

from deepspeed_zero3.runtime.zero.upstream_names import *  # noqa: F401,F403  [Note: upstream's module names]
from deepspeed_zero3.runtime.zero.upstream_names import coordinator_debug_rank0 as debug_rank0  # noqa: F401

import contextlib
import os
import threading
from typing import Optional, Sequence

import torch
from torch.nn import Module, Parameter

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils.logging import logger

from deepspeed_zero3.activation import check_kill_switch
from deepspeed_zero3.runtime.zero.eager import eager_only
from deepspeed_zero3.runtime.zero.gather import Gatherer, InflightParamRegistry, expect_status
from deepspeed_zero3.runtime.zero.keep_rule import KeepRule
from deepspeed_zero3.runtime.zero.keeping import BackwardKeeping
from deepspeed_zero3.runtime.zero.leaf_granularity import FastLeafSharding
from deepspeed_zero3.runtime.zero.module_params import fetch_params, iter_params
from deepspeed_zero3.runtime.zero.nograd_keeping import NoGradKeeping
from deepspeed_zero3.runtime.zero.nvme_swap import (NvmeSwapIns, blocks_gather, free_persistent_buffers,
                                                    release_gathered_on_nvme)
from deepspeed_zero3.runtime.zero.pass_agreement import PassAgreement, pass_agreement_from_env
from deepspeed_zero3.runtime.zero.passes import BACKWARD_RAISED, PassKind
from deepspeed_zero3.runtime.zero.prediction import PassPrediction
from deepspeed_zero3.runtime.zero.prefetch import PassPrefetcher
from deepspeed_zero3.runtime.zero.profiling import EventTimings, module_range, pass_range
from deepspeed_zero3.runtime.zero.recompute import ExternalReads, in_autograd_engine
from deepspeed_zero3.runtime.zero.rank_agreement import PassOrderCheck, check_ranks_from_env, check_same_module_on_all_ranks
from deepspeed_zero3.runtime.zero.residency import Boundary, Released, Residency, releasable
from deepspeed_zero3.runtime.zero.running_pass import RunningPass
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.stats import PassStats, ZeroStats, print_line_if_due, stats_every_from_env
from deepspeed_zero3.runtime.zero.trace import PassProgress, PassTrace, StepOutcome, TraceCache


_NO_EVENT = contextlib.nullcontext()


class PartitionedParameterCoordinator:
    """Decides when each parameter is gathered and released. One per managed module tree."""

    # Upstream's event names ([Note: upstream's event timings]).
    FORWARD_FETCH_SUBMIT = 'forward_fetch_submit'
    FORWARD_FETCH_WAIT = 'forward_fetch_wait'
    FORWARD_PREFETCH_SUBMIT = 'forward_prefetch_submit'
    BACKWARD_FETCH_SUBMIT = 'backward_fetch_submit'
    BACKWARD_FETCH_WAIT = 'backward_fetch_wait'
    BACKWARD_PREFETCH_SUBMIT = 'backward_prefetch_submit'
    FORWARD_ALL_GATHER = 'forward_all_gather'
    BACKWARD_ALL_GATHER = 'backward_all_gather'

    def __init__(
        self,
        prefetch_bucket_sz: int,
        max_reuse_distance_in_numel: int,
        max_available_parameters_in_numel: int,
        allgather_stream,
        inflight_param_registry: InflightParamRegistry,
        prefetch_nvme: bool = False,
        timers=None,
        zero_quantized_weights: bool = False,
        zero_quantized_nontrainable_weights: bool = False,
        fast_sharding_for_leaf_module: bool = False,
        log_trace_cache_warnings: bool = False,
        trace_cache_size: int = 8,
        data_parallel_group=None,
    ) -> None:
        # Upstream's switch, read from this module so that a patch applies ([Note: upstream's event timings]).
        self.events = (EventTimings(PartitionedParameterProfiler(timers))  # noqa: F405
                       if ENABLE_PROFILER else None)  # noqa: F405
        self.settings = PrefetchSettings.from_config_values(prefetch_bucket_sz, max_available_parameters_in_numel,
                                                            max_reuse_distance_in_numel)
        self.inflight = inflight_param_registry
        self.gatherer = Gatherer(allgather_stream, inflight_param_registry, zero_quantized_weights)
        self.zero_quantized_weights = zero_quantized_weights
        self.zero_quantized_nontrainable_weights = zero_quantized_nontrainable_weights
        self.fast_sharding_for_leaf_module = fast_sharding_for_leaf_module
        self.leaf_sharding = FastLeafSharding(fast_sharding_for_leaf_module)
        # ZenFlow's transposition of fetched parameters (zenflow_params.py); set by the engine that asks for it.
        self.param_layout = None
        self.log_trace_cache_warnings = log_trace_cache_warnings
        self.timers = timers
        self.hierarchy = 0  # upstream's attribute; stage 3 sets it
        # NVMe parameter offload: partitions read ahead of the gather walk ([Note: NVMe swap-in ahead]).
        # Each pass holds its own reads ahead (``RunningPass.swap_ins``).
        self.prefetch_nvme = prefetch_nvme

        self.traces = TraceCache(trace_cache_size)
        self.prediction = PassPrediction()
        self.keeping = BackwardKeeping()
        self.nograd_keeping = NoGradKeeping()
        self.external_reads = ExternalReads()  # [Note: release at last use in a recompute]
        self.stats = ZeroStats()
        # The pass running now, None between passes ([Note: the running pass]).
        self.running: Optional[RunningPass] = None
        # What is gathered, and what of it stays gathered on purpose ([Note: residency]).
        self.residency = Residency(self.stats, self.gatherer, self._counting)
        self.root_depth = 0
        check_kill_switch(os.environ)
        self.stats_every = stats_every_from_env(os.environ)
        self.check_ranks = check_ranks_from_env(os.environ)
        self.order_check = PassOrderCheck(data_parallel_group)
        self.pass_agreement = PassAgreement(data_parallel_group, pass_agreement_from_env(os.environ))
        self.backward_passes = 0
        # Autograd may run backward hooks on its own threads (GPU, multi-output z3 leaf modules).
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ settings and state

    def apply_settings(self, settings: PrefetchSettings) -> None:
        with self.lock:
            self.settings = settings

    @property
    def live_numel(self) -> int:
        return self.residency.numel

    def _counting(self) -> PassStats:
        """The counters a gather or a peak counts into: the running pass's, else those outside any pass."""
        return self.running.stats if self.running is not None else self.stats.outside_pass

    def running_kind(self) -> Optional[str]:
        """The running pass's kind (``"forward"``, ``"eval_forward"``, ``"backward"``), None between passes."""
        running = self.running
        return running.kind.value if running is not None else None

    def is_complete_trace(self) -> bool:
        """Whether the running pass replays a recorded trace (upstream's name)."""
        return self.running is not None and self.running.progress.replaying()

    def is_record_trace(self) -> bool:
        return self.running is not None and not self.running.progress.replaying()

    def is_invalid_trace(self) -> bool:
        return self.running is None

    def invalidate_traces(self) -> None:
        """Forget every recorded trace (module order or ds_ids changed)."""
        with self.lock:
            self.traces.clear()
            self.prediction.clear()
            self.keeping.clear()
            self.nograd_keeping.clear()
            self.residency.demote_next_eval()
            self.external_reads.clear()

    _invalidate_trace = invalidate_traces

    # ------------------------------------------------------------------ pass boundaries

    def enter_root_forward(self) -> None:
        """A root module's forward begins. The outermost one outside autograd starts a forward pass."""
        if in_autograd_engine():
            return
        with self.lock:
            self.root_depth += 1
            if self.root_depth == 1:
                self.begin_forward_pass()

    def exit_root_forward(self, aborted: bool) -> None:
        if in_autograd_engine():
            return
        with self.lock:
            self.root_depth = max(0, self.root_depth - 1)
            if self.root_depth == 0:
                self.end_forward_pass(aborted=aborted)

    def begin_forward_pass(self) -> None:
        with self.lock:
            self._end_open_pass(Boundary.FORWARD_BEGINS)  # [Note: keeping across no-grad passes]
            kind = PassKind.FORWARD if torch.is_grad_enabled() else PassKind.EVAL_FORWARD
            if self.events is not None:
                self.events.forward_began()
            self._begin_pass(kind, self.prediction.forward_guess(kind, self.traces))

    def end_forward_pass(self, aborted: bool = False) -> None:
        with self.lock:
            running = self.running
            if running is None or running.is_backward:
                return
            if not aborted and running.gathered == 0 and running.released == 0:
                self._end_pass(running, aborted=False, compare=False)  # [Note: silent passes] (passes.py)
                return
            trace = self._finish_trace(running, aborted)  # None if aborted: nothing then qualifies to survive
            if running.kind is PassKind.FORWARD:
                backward = self.keeping.kept_for(trace, self.prediction)
                boundary = Boundary.FORWARD_ENDS
                qualifying = (lambda p: backward.next_use(p, -1) is not None) if backward is not None else None
                self.keeping.forward_ended(trace)
            else:
                boundary = Boundary.EVAL_FORWARD_ENDS
                qualifying = self.nograd_keeping.planned(trace, self.settings).__contains__ if trace is not None else None
            self._end_pass(running, aborted)
            self._release_all(Boundary.RESET if aborted else boundary, qualifying)
            if not aborted and self.order_check.due(running.kind):
                self.order_check.check()  # [Note: diverging ranks]

    def begin_backward_pass(self) -> RunningPass:
        with self.lock:
            running = self._begin_pass(PassKind.BACKWARD,
                                       self.prediction.backward_guess(self.keeping.awaiting, self.traces))
            if in_autograd_engine():  # [Note: the end of a backward]
                torch.autograd.Variable._execution_engine.queue_callback(lambda: self._autograd_finished(running))
            # Prime: the first backward module should find its parameters in flight.
            self._prefetch(running, step=-1)
            return running

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def _autograd_finished(self, running: RunningPass) -> None:
        """The graph task that began ``running`` completed: close it ([Note: the end of a backward], passes.py)."""
        with self.lock:
            if self.running is running:
                self.end_backward_pass()

    def end_backward_pass(self, aborted: bool = False) -> None:
        with self.lock:
            running = self.running
            if running is None or not running.is_backward:
                return
            self.keeping.backward_ended(self._finish_trace(running, aborted))
            self._end_pass(running, aborted)
            self.external_reads.backward_ended()
            self._release_all(Boundary.BACKWARD_ENDS)
            if not aborted and self.order_check.due(PassKind.BACKWARD):
                self.order_check.check()  # [Note: diverging ranks]
            self.backward_passes += 1
            print_line_if_due(self.stats, self.backward_passes, self.stats_every)

    def _end_open_pass(self, boundary: Boundary, abandoning: bool = False) -> None:
        """Close a pass whose closing hook never came (as aborted), then release what does not survive
        ``boundary`` ([Note: residency])."""
        running = self.running
        if running is not None and not running.is_backward:
            self.end_forward_pass(aborted=True)
        elif running is not None:
            # Its graph task's completion would have closed it ([Note: the end of a backward]): cut short by an
            # exception (its partial order must not become a trace), or begun outside the autograd engine by a
            # direct hook call that never closed it.
            if not abandoning:
                logger.warning(BACKWARD_RAISED)
            self.end_backward_pass(aborted=True)
        self._release_all(boundary)

    def _begin_pass(self, kind: PassKind, guess: Optional[PassTrace]) -> RunningPass:
        """[Note: the running pass]: the one place a pass's state is created."""
        running = RunningPass(kind, PassProgress(kind, self.traces, guess), self._make_prefetcher(kind, guess),
                              self.stats.begin_pass(kind), NvmeSwapIns() if self.prefetch_nvme else None)
        running.keep_rule = self._keep_rule(running)
        self.running = running
        return running

    def _end_pass(self, running: RunningPass, aborted: bool, compare: bool = True) -> None:
        """[Note: the running pass]: the one place a pass's state is dropped."""
        # An aborted pass is neither compared nor has its external reads committed: its exception may have hit one
        # rank only, and a collective now would pair with whatever the other ranks are running. Nor is a silent
        # one ([Note: silent passes]).
        if compare and not aborted:
            self.external_reads.commit(running.external_reads, running.kind is PassKind.FORWARD)
            if running.progress.observed:
                self.order_check.add(running.stats.index, running.kind, running.progress.observed_ids, running.progress.observed)
        if running.swap_ins is not None:
            running.stats.swap_in_unused += running.swap_ins.end_pass()
        for module in running.recompute_owners.values():
            module.ds_recompute_parameters.clear()  # what is still gathered is released with the pass
        if self.events is not None:
            self.events.pass_ended(replayed=running.progress.replaying())
        self.stats.end_pass(running.stats, aborted=aborted)
        self.running = None

    def _make_prefetcher(self, kind: PassKind, trace: Optional[PassTrace]) -> Optional[PassPrefetcher]:
        if trace is None or self.settings.bucket_numel == 0:
            return None
        return PassPrefetcher(kind.role, trace, self.settings.bucket_numel)

    def _finish_trace(self, running: RunningPass, aborted: bool) -> Optional[PassTrace]:
        """The trace the ending pass ran (None if aborted), recorded if the cache had none like it."""
        if aborted:
            return None
        trace, recorded = self.traces.finish(running.progress)
        if recorded:
            running.stats.trace_records += 1
            self._log(f"recorded {trace.describe()}")
        return trace

    # ------------------------------------------------------------------ fetch and release

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def fetch_sub_module(self, current_submodule: Module, forward: bool) -> None:
        """Make the parameters of ``current_submodule`` available, then prefetch ahead in this pass."""
        # [Note: profiler ranges]
        with self.lock, module_range("fetch", current_submodule, " forward" if forward else " backward"):
            running = self.running
            if running is None and (not forward or in_autograd_engine()):
                running = self.begin_backward_pass()
            step = self._observe(running, current_submodule) if running is not None else -1
            if self.check_ranks:
                kind, observed = (running.kind, running.progress.step) if running is not None else (PassKind.FORWARD, -1)
                check_same_module_on_all_ranks(kind, observed, current_submodule, self.order_check.group)
            params = (running.params_to_fetch(current_submodule, step) if running is not None
                      else fetch_params(current_submodule))
            backward = running is not None and running.is_backward
            if backward:
                running.active_backward[current_submodule.ds_id] = current_submodule
            self.external_reads.mark_in_use(current_submodule, params,
                                            running.external_reads if backward and not forward else None)
            if self.prefetch_nvme:
                self._make_swap_room(running, params)
            with self._event(self.FORWARD_FETCH_SUBMIT if forward else self.BACKWARD_FETCH_SUBMIT, params, "fetch"):
                self._gather(running, params, prefetch=False, forward=forward)
            with module_range("wait", current_submodule), self._event(
                    self.FORWARD_FETCH_WAIT if forward else self.BACKWARD_FETCH_WAIT, params, "wait"):
                self.gatherer.wait(params, fast_leaf=self.leaf_sharding.applies_to(current_submodule))
            if self.prefetch_nvme:
                free_persistent_buffers(params)
            expect_status(params, ZeroParamStatus.AVAILABLE, "the fetch of module {} ds_id={} at step {}",
                          type(current_submodule).__name__, current_submodule.ds_id, step)
            if running is not None:
                self._prefetch(running, step, current_submodule)
            if self.param_layout is not None:
                self.param_layout.after_fetch(current_submodule)

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def gather_read(self, param: Parameter) -> None:
        """Gather ``param`` for a read outside its module's fetch (the getter, a returned parameter) with upstream's
        call, ``param.all_gather()``, counted in the running pass and recorded ([Note: residency])."""
        with self.lock:
            if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                param.all_gather()  # gathers nothing: upstream's call, kept for what it does besides
                return
            running = self.running
            self._agree_before_gathering(running)
            param.all_gather()
            self._count_gathered(running, (param, ), prefetch=False)
            self.residency.add_read(param)

    def note_external_read(self, module: Module, param: Parameter) -> None:
        """``module`` read its external parameter ``param`` now ([Note: release at last use in a recompute]): into
        the running pass's reads, committed at its end; between passes, at once."""
        with self.lock:
            self.external_reads.record(module, param, self.running.external_reads if self.running is not None else None)

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def complete_gather(self, param: Parameter) -> None:
        """Finish the prefetch of ``param`` for a read outside its module's fetch ([Note: a parameter read while
        in flight], ordered_dict.py)."""
        with self.lock:
            self.gatherer.wait([param])
            expect_status((param, ), ZeroParamStatus.AVAILABLE, "completing its gather")

    def _observe(self, running: RunningPass, module: Module) -> int:
        outcome = running.progress.observe(module)
        step = running.step
        if outcome is StepOutcome.SWITCHED:
            running.stats.trace_switches += 1
            if running.prefetcher is not None:
                for stale in running.prefetcher.rebase(running.progress.trace, step):
                    self._release(running, stale)
            else:
                running.prefetcher = self._make_prefetcher(running.kind, running.progress.trace)
                if running.prefetcher is not None:
                    running.prefetcher.reached(step)
            running.keep_rule = self._keep_rule(running)
        elif outcome is StepOutcome.DIVERGED:
            running.stats.trace_mismatches += 1
            self._log(f"{running.kind.value} pass left its trace at step {step} "
                      f"(module {type(module).__name__} ds_id={module.ds_id}); fetching on demand until it ends")
            running.prefetcher = None
            running.keep_rule = self._keep_rule(running)
        return step

    def _prefetch(self, running: RunningPass, step: int, module: Optional[Module] = None) -> None:
        """Issue the gathers the prefetcher plans now; ``module`` (None when priming a pass) names the range."""
        prefetcher = running.prefetcher
        if prefetcher is None:
            return
        prefetcher.reached(step)
        wanted = prefetcher.plan(self.live_numel, self.settings.max_live_numel,
                                 stop_at=blocks_gather if self.prefetch_nvme else None)
        if wanted:
            forward = not running.is_backward
            with (module_range("prefetch", module, params=wanted)
                  if module is not None else pass_range("prefetch", " " + prefetcher.role + " start", wanted)), \
                    self._event(self.FORWARD_PREFETCH_SUBMIT if forward else self.BACKWARD_PREFETCH_SUBMIT, wanted,
                                "prefetch"):
                self._gather(running, wanted, prefetch=True, forward=forward)
        if running.swap_ins is not None:
            running.stats.swap_in_ahead += running.swap_ins.read_ahead(prefetcher.trace.param_uses, prefetcher.cursor,
                                                                    self.settings.bucket_numel)

    def _make_swap_room(self, running: Optional[RunningPass], params) -> None:
        """A demand fetch reads partitions from NVMe synchronously: count them, and free buffers for them."""
        needed = [p for p in params if blocks_gather(p)]
        if not needed:
            return
        (running.stats if running is not None else self.stats.outside_pass).swap_in_demand += len(needed)
        reads = running.swap_ins if running is not None else NvmeSwapIns()  # between passes nothing was read ahead
        reads.make_room(needed, lambda count: self._release_gathered_for_swap_room(running, count))

    def _release_gathered_for_swap_room(self, running: Optional[RunningPass], count: int) -> None:
        """Free ``count`` swap buffers by releasing gathered parameters not in use (kept, then prefetched)."""
        prefetcher = running.prefetcher if running is not None else None
        candidates = list(self.residency.parked()) + (list(prefetcher.outstanding) if prefetcher is not None else [])
        release_gathered_on_nvme(candidates, count, lambda param: self._release(running, param))

    def _event(self, name: str, params, what: str):
        """Upstream's profiler event ``name`` around a ``what`` of ``params`` (a no-op unless ENABLE_PROFILER)."""
        return self.events.around(name, params, what, self.inflight) if self.events is not None else _NO_EVENT

    def _agree_before_gathering(self, running: Optional[RunningPass]) -> None:
        """[Note: ranks in different passes]: called just before an all-gather is issued; before the running pass's
        first, the ranks agree on the pass."""
        if running is None or running.agreed:
            return
        running.agreed = True
        if self.pass_agreement.applies():
            running.stats.pass_checks += 1  # counted before it may raise: the exchange is issued either way
            self.pass_agreement.agree(running.kind)

    def _gather(self, running: Optional[RunningPass], params: Sequence[Parameter], prefetch: bool,
                forward: bool = True) -> None:
        timed = None
        if self.events is not None:
            name = self.FORWARD_ALL_GATHER if forward else self.BACKWARD_ALL_GATHER
            timed = lambda group: self.events.event(name, sum(p.ds_numel for p in group))  # noqa: E731
        for group in self.gatherer.submit(params, timed=timed, before=lambda: self._agree_before_gathering(running)):
            self._count_gathered(running, group, prefetch)
            self.residency.add(group)

    def _count_gathered(self, running: Optional[RunningPass], group: Sequence[Parameter], prefetch: bool) -> None:
        """One all-gather of ``group`` was issued: counted in ``running`` (or outside any pass)."""
        (running.stats if running is not None else self.stats.outside_pass).on_allgather(
            sum(p.ds_numel for p in group), prefetch=prefetch)
        if running is not None:
            running.gathered += 1

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def release_sub_module(self, submodule: Module, forward: bool = False, backward_follows: bool = True) -> None:
        """Release what ``submodule`` used, unless it is in use, claimed ahead, or kept. ``backward_follows``
        (forward hooks only): whether the module's outputs carry a gradient, so a backward of its own follows."""
        with self.lock, module_range("release", submodule, " forward" if forward else " backward"):
            running = self.running
            if forward and running is not None and running.is_backward and submodule.ds_id in running.active_backward:
                # A checkpoint recomputes this module's forward inside the backward (torch's early stop raises
                # out of it, which always_call forward hooks see as backward_follows): its backward has yet to
                # use the parameters, and its post-backward releases them. With no backward to come, this
                # forward was their last use ([Note: release at last use in a recompute]).
                if backward_follows:
                    return
                running.active_backward.pop(submodule.ds_id, None)
            step = running.step if running is not None else -1
            prefetcher = running.prefetcher if running is not None else None
            keep_rule = running.keep_rule if running is not None else None
            partition = self.leaf_sharding.releaser() if self.leaf_sharding.applies_to(submodule) else None
            params = (running.params_to_release(submodule) if running is not None
                      else fetch_params(submodule, strict=False))
            recomputed = () if forward else submodule.__dict__.get("ds_recompute_parameters")
            if recomputed:
                # Upstream's attribution (update_recompute_parameters): released with this module's backward.
                params = list(params) + [p for p in recomputed if not p.ds_persist]
                recomputed.clear()
            for param in params:
                param.ds_active_sub_modules.discard(submodule.ds_id)
                if (param.ds_persist or param.is_external_param or not releasable(param)
                        or param.ds_status != ZeroParamStatus.AVAILABLE or not self.residency.recorded(param)):
                    continue  # not this module's to release: in use, held, persistent, or gathered by another
                if prefetcher is not None and prefetcher.holds(param, step):
                    prefetcher.adopt(param)
                    continue
                reason = keep_rule.reason(param, step, self.live_numel, self.settings) if keep_rule else None
                if reason is not None:
                    self.residency.park(param, reason)
                    continue
                self._release(running, param, partition)
            if self.param_layout is not None:
                self.param_layout.after_release(submodule)
            if not forward and running is not None:
                running.active_backward.pop(submodule.ds_id, None)

    def _keep_rule(self, running: RunningPass) -> KeepRule:
        """[Note: a keep rule per pass]: built when a pass begins and when its replayed trace switches or is left."""
        trace = running.replayed_trace()
        following = self.keeping.kept_for(trace, self.prediction) if running.kind is PassKind.FORWARD else None
        return KeepRule(running.kind, trace, following, self.keeping, self.nograd_keeping)

    def _release(self, running: Optional[RunningPass], param: Parameter, partition=None) -> None:
        """``Residency.release``, counted for the running pass; its prefetcher forgets what was released."""
        outcome = self.residency.release(param, partition)
        if outcome is Released.HELD:
            return  # the prefetcher's records too stay as they are
        if outcome is Released.PARTITIONED and running is not None:
            running.released += 1
        if running is not None and running.prefetcher is not None:
            running.prefetcher.forget(param)

    def _release_all(self, boundary: Boundary, qualifying=None) -> None:
        """Complete every gather in flight and release every gathered parameter of ours but the survivors of
        ``boundary`` (``qualifying``: its filter, [Note: residency]). Between passes: each caller ended the pass."""
        with self.lock:
            self.gatherer.wait_all()
            if self.param_layout is not None:
                self.param_layout.restore_all()
            survivors = set(self.residency.cross(boundary, qualifying))
            for param in self.residency.gathered():
                if param in survivors and param.ds_status == ZeroParamStatus.AVAILABLE:
                    continue
                param.ds_active_sub_modules.clear()
                self._release(None, param)

    @torch.no_grad()
    def after_state_load(self) -> None:
        """A ``load_state_dict`` over the model ended. A parameter kept gathered between passes was not gathered by
        the loader (upstream's loaders gather only NOT_AVAILABLE ones), so the load wrote into its full copy only:
        partition that copy (the loaded values) and release it, or the next release would drop the load
        ([Note: keeping across no-grad passes]). No collective: each rank partitions its own copy."""
        with self.lock:
            if self.running is not None:
                return  # a load inside a forward is the forward's business
            for param in self.residency.parked():
                if param.ds_status == ZeroParamStatus.AVAILABLE and releasable(param):
                    param.partition(has_been_updated=True)  # the load's exception: the loaded values are kept
                self.residency.forget(param)

    # ------------------------------------------------------------------ upstream entry points

    @eager_only  # [Note: what Dynamo may trace]
    def reset_step(self, abandoning: bool = False) -> None:
        """End whatever pass is running and release everything gathered (upstream's end-of-step call)."""
        with self.lock:
            self._end_open_pass(Boundary.RESET, abandoning)
            self.root_depth = 0
            if abandoning:
                self.keeping.abandon()

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def release_backward_leftovers(self) -> None:
        """End of ``engine.backward()``: close the backward pass, if its graph task's completion has not already
        ([Note: the end of a backward])."""
        with self.lock:
            self.end_backward_pass()

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def release_and_reset_all(self, module: Module) -> None:
        """Release every parameter of ``module``, persistent ones included (stage 3 calls this at step())."""
        with self.lock:
            self.reset_step()
            if self.param_layout is not None:
                self.param_layout.restore_all()
            # Plain parameters of modules attached after initialize are not ours (warn_unmanaged, ordered_dict.py).
            params = [p for p in iter_params(module, recurse=True) if hasattr(p, "ds_id")]
            for param in params:
                if param in self.inflight:
                    self.inflight.pop(param).wait()
                param.ds_active_sub_modules.clear()
                if param.ds_status == ZeroParamStatus.AVAILABLE:
                    param.partition()
                self.residency.forget(param)
            expect_status(params, ZeroParamStatus.NOT_AVAILABLE, "release_and_reset_all")

    def _log(self, message: str) -> None:
        if self.log_trace_cache_warnings:
            logger.warning(f"deepspeed-zero3: {message}")
        else:
            logger.debug(f"deepspeed-zero3: {message}")
