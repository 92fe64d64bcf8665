"""Fetch and release of a submodule's partitioned parameters (served as upstream's
``deepspeed.runtime.zero.partitioned_param_coordinator``).

What differs from upstream, in one place:

* Passes, not steps. A forward pass runs from the root module's pre-forward
  hook to its forward hook; a backward pass from the first backward hook to the
  end of ``engine.backward()`` (stage 3's ``release_backward_leftovers``). Each
  pass follows its own trace (``trace.py``) and has its own prefetcher
  (``prefetch.py``), so prefetching never crosses from forward into backward.
  See [Note: one prefetcher per pass].
* The pass kind comes from grad mode and from whether the autograd engine is
  running, never from ``nn.Module.training``; nothing here asserts on it.
* Traces are cached per pass kind and selected by what runs
  ([Note: trace selection]), so train/eval alternation, training-only branches
  and generation loops stop re-recording once seen.
* Gathered memory is bounded by the config ([Note: the prefetch window]):
  module in use + prefetch window + what ``stage3_max_reuse_distance`` keeps.
* One coordinator per managed module tree, shared by every engine over it
  (``param_registry.py``).
* Counters for tests and benchmarks (``stats.py``).
"""

import enum
import os
import threading
from typing import Dict, Iterable, Optional

import torch
from torch.nn import Module, Parameter

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils.logging import logger

from deepspeed_zero3.runtime.zero.gather import Gatherer, InflightParamRegistry, held_by_gathered_parameters
from deepspeed_zero3.runtime.zero.leaf_granularity import FastLeafSharding
from deepspeed_zero3.runtime.zero.module_params import fetch_params, iter_params
from deepspeed_zero3.runtime.zero.prefetch import PassPrefetcher
from deepspeed_zero3.runtime.zero.rank_agreement import (CHECK_RANKS_ENV, PassOrderCheck, check_ranks_from_env,
                                                         check_same_module_on_all_ranks)
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.stats import PassKind, ZeroStats, format_line, stats_every_from_env
from deepspeed_zero3.runtime.zero.trace import PassProgress, PassTrace, StepOutcome, TraceCache

__all__ = [
    "PartitionedParameterCoordinator", "InflightParamRegistry", "iter_params", "PassPhase", "PassKind",
    "NVME_NOT_SUPPORTED", "CHECK_RANKS_ENV"
]

NVME_NOT_SUPPORTED = ("NVMe parameter offload (offload_param.device='nvme') is not supported by deepspeed-zero3 yet; "
                      "use offload_param.device 'cpu' or 'none', or set DEEPSPEED_ZERO3=0 to run upstream's runtime")


class PassPhase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def in_autograd_engine() -> bool:
    """True while the autograd engine executes a graph (backward, and recomputation inside it)."""
    return torch._C._current_graph_task_id() != -1


class PartitionedParameterCoordinator:
    """Decides when each parameter is gathered and released. One per managed module tree."""

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
        if prefetch_nvme:
            raise NotImplementedError(NVME_NOT_SUPPORTED)
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

        self.traces = TraceCache(trace_cache_size)
        self.stats = ZeroStats()
        self.phase = PassPhase.IDLE
        self.progress: Optional[PassProgress] = None
        self.forward_prefetcher: Optional[PassPrefetcher] = None
        self.backward_prefetcher: Optional[PassPrefetcher] = None
        # The forward trace whose backward has not run yet: its backward trace is the best guess.
        self.awaiting_backward_from: Optional[PassTrace] = None
        # Gathered non-persistent parameters this coordinator is responsible for (an ordered set).
        self.live: Dict[Parameter, None] = {}
        # Parameters kept gathered after use because the reuse distance says they come back soon.
        self.reuse_kept: Dict[Parameter, None] = {}
        # Modules fetched in this backward whose post-backward hook has not fired yet.
        self.active_backward: Dict[int, Module] = {}
        self.root_depth = 0
        self.stats_every = stats_every_from_env(os.environ)
        self.check_ranks = check_ranks_from_env(os.environ)
        self.order_check = PassOrderCheck(data_parallel_group)
        self.backward_passes = 0
        # Autograd may run backward hooks on its own threads (GPU, multi-output z3 leaf modules).
        self.lock = threading.RLock()

    # ------------------------------------------------------------------ settings and state

    def apply_settings(self, settings: PrefetchSettings) -> None:
        with self.lock:
            self.settings = settings

    @property
    def live_numel(self) -> int:
        return self.stats.live_numel

    def current_prefetcher(self) -> Optional[PassPrefetcher]:
        if self.phase is PassPhase.FORWARD:
            return self.forward_prefetcher
        if self.phase is PassPhase.BACKWARD:
            return self.backward_prefetcher
        return None

    def is_complete_trace(self) -> bool:
        """Whether the running pass replays a recorded trace (upstream's name)."""
        return self.progress is not None and self.progress.replaying()

    def is_record_trace(self) -> bool:
        return self.progress is not None and not self.progress.replaying()

    def is_invalid_trace(self) -> bool:
        return self.progress is None

    def invalidate_traces(self) -> None:
        """Forget every recorded trace (module order or ds_ids changed)."""
        with self.lock:
            self.traces.clear()
            self.awaiting_backward_from = None

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
            if self.root_depth == 0 and self.phase is PassPhase.FORWARD:
                self.end_forward_pass(aborted=aborted)

    def _end_open_pass(self, abandoning: bool = False) -> None:
        """Close a pass whose closing hook never came, and release everything gathered."""
        if self.phase is PassPhase.FORWARD:
            self.end_forward_pass(aborted=True)
        elif self.phase is PassPhase.BACKWARD:
            # Either a backward that finished without engine.backward()'s epilogue (a trace worth keeping),
            # or one cut short by an exception (its partial order must not become a trace).
            cut_short = not self.progress.autograd_finished
            if cut_short and not abandoning:
                logger.warning("deepspeed-zero3: a backward pass raised before it finished; the parameters it "
                               "gathered are now released and its partial module order is not kept as a trace. "
                               "Stage 3 still holds that backward's partial gradients: call "
                               "deepspeed_zero3.abandon_step(engine) after catching the exception to drop them.")
            self.end_backward_pass(aborted=cut_short)
        self.release_all_ours(keep=())

    def begin_forward_pass(self) -> None:
        with self.lock:
            self._end_open_pass()
            kind = PassKind.FORWARD if torch.is_grad_enabled() else PassKind.EVAL_FORWARD
            guess = self.traces.most_recent(kind)
            self._begin_pass(PassPhase.FORWARD, kind, guess)
            self.forward_prefetcher = self._make_prefetcher("forward", guess)

    def end_forward_pass(self, aborted: bool = False) -> None:
        with self.lock:
            if self.phase is not PassPhase.FORWARD:
                return
            if not aborted and self.stats.current.allgather_calls == 0:
                self._end_silent_forward()
                return
            kind = self.progress.kind
            trace = self._finish_trace(aborted)
            self.forward_prefetcher = None
            keep = ()
            if kind is PassKind.FORWARD:
                self.awaiting_backward_from = trace
                if trace is not None and trace.next_backward is not None:
                    keep = tuple(p for p in self.reuse_kept if trace.next_backward.next_use(p, -1) is not None)
            self._end_pass(aborted)
            self.release_all_ours(keep=keep)
            if not aborted and self.order_check.due(kind):
                self.order_check.check()  # [Note: diverging ranks]

    def _end_silent_forward(self) -> None:
        """[Note: silent passes] A forward that issued no all-gather leaves the runtime as it found it.

        Such a forward found every parameter already gathered: inside ``GatheredParameters`` over the model,
        or with every parameter persistent. That is how a forward can legitimately run on one rank only
        (a sample or a log on rank 0). Recording its trace, or moving a cached one to the front, would make
        that rank's next prefetches differ from the other ranks', and an order check would be a collective
        only that rank reaches. So it records nothing, adds nothing to the order check and, having gathered
        nothing, releases nothing at its end. What the context holds is not released at module ends either
        (``held_by_gathered_parameters``), so a module that runs twice is not gathered again, and what the
        last forward kept for its backward stays kept. Passes where every rank gathers are unaffected; a
        rank that runs alone *and* gathers still cannot be helped.
        """
        self.forward_prefetcher = None
        self._end_pass(aborted=False, compare=False)

    def begin_backward_pass(self) -> None:
        with self.lock:
            guess = None
            if self.awaiting_backward_from is not None:
                guess = self.awaiting_backward_from.next_backward
            if guess is None:
                guess = self.traces.most_recent(PassKind.BACKWARD)
            self._begin_pass(PassPhase.BACKWARD, PassKind.BACKWARD, guess)
            if in_autograd_engine():
                progress = self.progress
                torch.autograd.Variable._execution_engine.queue_callback(
                    lambda: setattr(progress, "autograd_finished", True))
            self.backward_prefetcher = self._make_prefetcher("backward", guess)
            # Prime: the first backward module should find its parameters in flight.
            self._prefetch(step=-1)

    def end_backward_pass(self, aborted: bool = False) -> None:
        with self.lock:
            if self.phase is not PassPhase.BACKWARD:
                return
            trace = self._finish_trace(aborted)
            if self.awaiting_backward_from is not None and trace is not None:
                self.awaiting_backward_from.next_backward = trace
            self.awaiting_backward_from = None
            self.backward_prefetcher = None
            self.active_backward.clear()
            self._end_pass(aborted)
            self.release_all_ours(keep=())
            if not aborted and self.order_check.due(PassKind.BACKWARD):
                self.order_check.check()  # [Note: diverging ranks]
            self.backward_passes += 1
            if self.stats_every and self.backward_passes % self.stats_every == 0 and (not dist.is_initialized()
                                                                                     or dist.get_rank() == 0):
                logger.info(format_line(self.stats))

    def _begin_pass(self, phase: PassPhase, kind: PassKind, guess: Optional[PassTrace]) -> None:
        self.phase = phase
        self.progress = PassProgress(kind, self.traces, guess)
        self.stats.begin_pass(kind)

    def _end_pass(self, aborted: bool, compare: bool = True) -> None:
        # An aborted pass is not compared: its exception may have hit one rank only, and a collective now
        # would pair with whatever the other ranks are running. Nor is a silent one ([Note: silent passes]).
        if compare and not aborted and self.progress.observed:
            self.order_check.add(self.stats.current.index, self.progress.kind, self.progress.observed_ids,
                                 self.progress.observed)
        self.stats.end_pass(aborted=aborted)
        self.phase = PassPhase.IDLE
        self.progress = None

    def _make_prefetcher(self, role: str, trace: Optional[PassTrace]) -> Optional[PassPrefetcher]:
        if trace is None or self.settings.bucket_numel == 0:
            return None
        return PassPrefetcher(role, trace, self.settings.bucket_numel)

    def _finish_trace(self, aborted: bool) -> Optional[PassTrace]:
        """The trace the ending pass ran, recording it if the cache has none like it."""
        progress = self.progress
        if aborted or not progress.observed:
            return None
        trace = progress.completed_trace()
        if trace is None:
            trace = self.traces.find(progress.kind, progress.observed_ids, exact=True)
            if trace is not None and not trace.runs(progress.observed):
                trace = None
        if trace is None:
            trace = PassTrace(progress.kind, progress.observed)
            self.stats.current.trace_records += 1
            self._log(f"recorded {trace.describe()}")
        self.traces.touch(trace)
        return trace

    # ------------------------------------------------------------------ fetch and release

    @torch.no_grad()
    def fetch_sub_module(self, current_submodule: Module, forward: bool) -> None:
        """Make the parameters of ``current_submodule`` available, then prefetch ahead in this pass."""
        with self.lock:
            if (not forward or in_autograd_engine()) and self.phase is PassPhase.IDLE:
                self.begin_backward_pass()
            step = -1
            if self.progress is not None:
                step = self._observe(current_submodule)
            if self.check_ranks:
                kind = self.progress.kind if self.progress is not None else PassKind.FORWARD
                check_same_module_on_all_ranks(kind, step, current_submodule, self.order_check.group)
            params = fetch_params(current_submodule)
            if self.phase is PassPhase.BACKWARD:
                self.active_backward[current_submodule.ds_id] = current_submodule
            for param in params:
                param.ds_active_sub_modules.add(current_submodule.ds_id)
            self._gather(params, prefetch=False)
            if self.leaf_sharding.applies_to(current_submodule):
                self.leaf_sharding.wait(self.gatherer, params)
            else:
                self.gatherer.wait(params)
            for param in params:
                if param.ds_status != ZeroParamStatus.AVAILABLE:
                    raise RuntimeError(f"deepspeed-zero3: parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} "
                                       f"of module {type(current_submodule).__name__} ds_id={current_submodule.ds_id} "
                                       f"is {param.ds_status.name} after its fetch at step {step}; expected AVAILABLE")
            self._prefetch(step)
            if self.param_layout is not None:
                self.param_layout.after_fetch(current_submodule)

    def _observe(self, module: Module) -> int:
        outcome = self.progress.observe(module)
        step = self.progress.step
        prefetcher = self.current_prefetcher()
        if outcome is StepOutcome.SWITCHED:
            self.stats.current.trace_switches += 1
            if prefetcher is not None:
                for stale in prefetcher.rebase(self.progress.trace, step):
                    self._release(stale)
            else:
                self._set_prefetcher(self._make_prefetcher(self.phase.value, self.progress.trace))
                if self.current_prefetcher() is not None:
                    self.current_prefetcher().reached(step)
        elif outcome is StepOutcome.DIVERGED:
            self.stats.current.trace_mismatches += 1
            self._log(f"{self.progress.kind.value} pass left its trace at step {step} "
                      f"(module {type(module).__name__} ds_id={module.ds_id}); fetching on demand until it ends")
            self._set_prefetcher(None)
        return step

    def _set_prefetcher(self, prefetcher: Optional[PassPrefetcher]) -> None:
        if self.phase is PassPhase.FORWARD:
            self.forward_prefetcher = prefetcher
        elif self.phase is PassPhase.BACKWARD:
            self.backward_prefetcher = prefetcher

    def _prefetch(self, step: int) -> None:
        prefetcher = self.current_prefetcher()
        if prefetcher is None:
            return
        prefetcher.reached(step)
        wanted = prefetcher.plan(self.live_numel, self.settings.max_live_numel, is_persistent=lambda p: p.ds_persist)
        if wanted:
            self._gather(wanted, prefetch=True)

    def _gather(self, params: Iterable[Parameter], prefetch: bool) -> None:
        for group in self.gatherer.submit(params):
            self.stats.on_allgather(sum(p.ds_numel for p in group), prefetch=prefetch)
            for param in group:
                if not param.ds_persist and param not in self.live:
                    self.live[param] = None
                    self.stats.on_live_change(param.ds_numel)

    @torch.no_grad()
    def release_sub_module(self, submodule: Module, forward: bool = False) -> None:
        """Release what ``submodule`` used, unless it is in use, claimed ahead, or reused soon."""
        with self.lock:
            if forward and self.phase is PassPhase.BACKWARD and submodule.ds_id in self.active_backward:
                # A non-reentrant checkpoint recomputes this module's forward inside its own backward (and
                # torch's early stop raises out of it, which always_call forward hooks see): the backward has
                # yet to use the parameters (its AccumulateGrad included); its post-backward releases them.
                return
            step = self.progress.step if self.progress is not None else -1
            prefetcher = self.current_prefetcher()
            partition = self.leaf_sharding.releaser() if self.leaf_sharding.applies_to(submodule) else None
            for param in fetch_params(submodule, strict=False):
                param.ds_active_sub_modules.discard(submodule.ds_id)
                if (param.ds_persist or param.is_external_param or param.ds_active_sub_modules
                        or held_by_gathered_parameters(param)):
                    continue
                if param.ds_status != ZeroParamStatus.AVAILABLE:
                    continue
                if prefetcher is not None and prefetcher.holds(param, step):
                    prefetcher.adopt(param)
                    continue
                if self._reuse_keeps(param, step):
                    self.reuse_kept[param] = None
                    continue
                self._release(param, partition)
            if self.param_layout is not None:
                self.param_layout.after_release(submodule)
            if not forward:
                self.active_backward.pop(submodule.ds_id, None)

    def _reuse_keeps(self, param: Parameter, step: int) -> bool:
        """Whether ``param``'s next use in this pass (or, after a forward, in its backward) is within the reuse distance."""
        limit = self.settings.max_reuse_numel
        if limit == 0 or self.progress is None or not self.progress.replaying():
            return False
        if self.live_numel > self.settings.max_live_numel:
            return False
        trace = self.progress.trace
        next_step = trace.next_use(param, step)
        if next_step is not None:
            return trace.numel_between(step + 1, next_step) < limit
        backward = trace.next_backward if self.progress.kind is PassKind.FORWARD else None
        if backward is not None:
            first = backward.next_use(param, -1)
            if first is not None:
                return trace.numel_between(step + 1, len(trace)) + backward.numel_between(0, first) < limit
        return False

    def _release(self, param: Parameter, partition=None) -> None:
        """``partition``: how to partition it, if not ``param.partition()`` (fast leaf sharding)."""
        if held_by_gathered_parameters(param):
            # Left exactly as it is, bookkeeping included: the context partitions it at its exit on every
            # rank, and whatever we kept it for stays counted the same way on every rank.
            return
        if param.ds_status == ZeroParamStatus.INFLIGHT:
            self.gatherer.wait([param])
        # One coalesced handle covers several modules' parameters; a sibling's wait completed this one but
        # left it registered. Released unregistered, it would be refused as "in flight" at its next gather.
        self.inflight.pop(param, None)
        if param.ds_status == ZeroParamStatus.AVAILABLE and not param.ds_active_sub_modules:
            if partition is None:
                param.partition()
            else:
                partition(param)
        self._forget(param)

    def _forget(self, param: Parameter) -> None:
        self.reuse_kept.pop(param, None)
        prefetcher = self.current_prefetcher()
        if prefetcher is not None:
            prefetcher.forget(param)
        if param in self.live:
            del self.live[param]
            self.stats.on_live_change(-param.ds_numel)

    def release_all_ours(self, keep: Iterable[Parameter]) -> None:
        """Complete every gather in flight and release every gathered parameter of ours not in ``keep``."""
        with self.lock:
            self.gatherer.wait_all()
            if self.param_layout is not None:
                self.param_layout.restore_all()
            keep = set(keep)
            for param in list(self.live):
                if param in keep and param.ds_status == ZeroParamStatus.AVAILABLE:
                    continue
                param.ds_active_sub_modules.clear()
                self._release(param)

    # ------------------------------------------------------------------ post-backward bookkeeping

    def begin_module_grad_count(self, module: Module) -> None:
        """Start counting ``module``'s gradient-carrying inputs, once per pass (a module may run twice)."""
        stamp = self.stats.passes_started
        if module.__dict__.get("_zero3_grad_stamp") != stamp:
            module._zero3_grad_stamp = stamp
            module.ds_grads_remaining = 0

    def expect_input_grad(self, module: Module) -> None:
        module.ds_grads_remaining += 1

    def input_grad_arrived(self, module: Module) -> bool:
        """One input gradient of ``module`` is computed; True when it was the last (its backward is done)."""
        with self.lock:
            module.ds_grads_remaining -= 1
            return module.ds_grads_remaining == 0

    # ------------------------------------------------------------------ upstream entry points

    def reset_step(self, abandoning: bool = False) -> None:
        """End whatever pass is running and release everything gathered (upstream's end-of-step call)."""
        with self.lock:
            self._end_open_pass(abandoning)
            self.root_depth = 0

    @torch.no_grad()
    def release_backward_leftovers(self) -> None:
        """End of ``engine.backward()``: close the backward pass; release what post-backward hooks never did."""
        with self.lock:
            if self.phase is PassPhase.BACKWARD:
                self.end_backward_pass()
                return
            for submodule in list(self.active_backward.values()):
                self.release_sub_module(submodule, forward=False)
            self.active_backward.clear()

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
                self._forget(param)
            for param in params:
                if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
                    raise RuntimeError(f"deepspeed-zero3: parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} "
                                       f"is {param.ds_status.name} after release_and_reset_all; expected NOT_AVAILABLE")

    def _log(self, message: str) -> None:
        if self.log_trace_cache_warnings:
            logger.warning(f"deepspeed-zero3: {message}")
        else:
            logger.debug(f"deepspeed-zero3: {message}")
