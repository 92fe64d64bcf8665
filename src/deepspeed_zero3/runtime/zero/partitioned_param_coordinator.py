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
  and generation loops stop re-recording once seen. A kind with no trace yet
  replays a guess ([Note: first-pass prediction] in ``prediction.py``).
* Gathered memory is bounded by the config ([Note: the prefetch window]):
  module in use + prefetch window + what ``stage3_max_reuse_distance`` keeps;
  a forward keeps the backward's first parameters, within the cap less one
  bucket ([Note: budgeted keeping] in ``keeping.py``).
* One coordinator per managed module tree, shared by every engine over it
  (``param_registry.py``).
* Counters for tests and benchmarks (``stats.py``).
* Every module-level name of upstream's module exists, the imported ones as
  the same objects ([Note: upstream's module names]). Three belong to
  upstream's trace bookkeeping: ``ZeRoTraceMode`` is there for callers of the
  name (``is_record_trace()`` and friends answer the question), while
  ``update_recompute_parameters`` and ``ENABLE_PROFILER = True`` raise
  ``NotImplementedError`` saying what to use instead.
"""

import enum
import os
import threading
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch
from torch.nn import Module, Parameter

from deepspeed import comm as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.utils.logging import logger
# [Note: upstream's module names]
# Tests and client code import and patch module-level names of the two modules we replace (upstream's
# eager-fallback tests patch parameter_offload.print_rank_0), so each of ours has every module-level name
# upstream's has; tests/unit/test_module_api.py reads the list from upstream's files at test time.
# * A name upstream imports is imported here too: the same object. That includes upstream's star import of
#   partition_parameters, so the set follows the installed deepspeed version.
# * A name upstream defines is ours and does the same thing. Where it is upstream's own bookkeeping, which our
#   design replaces, it raises NotImplementedError naming what to use instead.
# * Debug lines upstream prints through print_rank_0 go through the module's name at call time, so patching it
#   has the effect it has upstream.
import collections
import logging
from collections import UserDict
from dataclasses import dataclass
from enum import Enum
from typing import Deque, Set

import deepspeed.runtime.compiler as compiler
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.compiler import is_compiling
from deepspeed.runtime.swap_tensor.partitioned_param_swapper import PartitionedParamStatus
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import *  # noqa: F401,F403
from deepspeed.runtime.zero.partitioned_param_profiler import PartitionedParameterProfiler
from deepspeed.utils import z3_leaf_module
from deepspeed.utils.debug import debug_param2name_id_shape
from deepspeed_zero3.runtime.zero.module_params import named_fetch_params

from deepspeed_zero3.runtime.zero.eager import eager_only
from deepspeed_zero3.runtime.zero.gather import Gatherer, InflightParamRegistry, held_by_gathered_parameters
from deepspeed_zero3.runtime.zero.keeping import BackwardKeeping
from deepspeed_zero3.runtime.zero.release import release as release_gathered
from deepspeed_zero3.runtime.zero.leaf_granularity import FastLeafSharding
from deepspeed_zero3.runtime.zero.module_params import fetch_params, iter_params
from deepspeed_zero3.runtime.zero.prediction import FirstPassPrediction
from deepspeed_zero3.runtime.zero.nvme_swap import (NvmeSwapIns, blocks_gather, on_nvme,
                                                    persistent_partitions_in_memory)
from deepspeed_zero3.runtime.zero.prefetch import PassPrefetcher
from deepspeed_zero3.runtime.zero.profiling import module_range, pass_range
from deepspeed_zero3.runtime.zero.rank_agreement import (CHECK_RANKS_ENV, PassOrderCheck, check_ranks_from_env,
                                                         check_same_module_on_all_ranks)
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings
from deepspeed_zero3.runtime.zero.stats import PassKind, ZeroStats, format_line, stats_every_from_env
from deepspeed_zero3.runtime.zero.trace import PassProgress, PassTrace, StepOutcome, TraceCache



class PassPhase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def _is_persistent(param: Parameter) -> bool:
    return param.ds_persist


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
        if ENABLE_PROFILER:
            raise NotImplementedError(PROFILER_NOT_SUPPORTED)
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
        self.swap_ins: Optional[NvmeSwapIns] = NvmeSwapIns() if prefetch_nvme else None

        self.traces = TraceCache(trace_cache_size)
        self.prediction = FirstPassPrediction()
        self.keeping = BackwardKeeping()
        self.stats = ZeroStats()
        self.phase = PassPhase.IDLE
        self.progress: Optional[PassProgress] = None
        self.forward_prefetcher: Optional[PassPrefetcher] = None
        self.backward_prefetcher: Optional[PassPrefetcher] = None
        # The forward trace whose backward has not run yet: its backward trace is the best guess.
        self.awaiting_backward_from: Optional[PassTrace] = None
        self.forwards_since_backward = 0  # forwards with grad begun since the last backward ended
        # Gathered non-persistent parameters this coordinator is responsible for (an ordered set).
        self.live: Dict[Parameter, None] = {}
        # Parameters kept gathered after use because the reuse distance says they come back soon.
        self.reuse_kept: Dict[Parameter, None] = {}
        # Modules fetched in this backward whose post-backward hook has not fired yet.
        self.active_backward: Dict[int, Module] = {}
        # Module ds_id -> the parameter list its last fetch in this pass read from the replayed trace: its
        # release covers exactly what that fetch did, with no second check ([Note: cached parameter lists]).
        self.fetched_from: Dict[int, Tuple[Parameter, ...]] = {}
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
            self.prediction.clear()
            self.keeping.clear()
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
            if kind is PassKind.FORWARD:
                self.forwards_since_backward += 1
            guess = self.prediction.forward_guess(kind, self.traces)
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
                backward = (self.prediction.backward_to_keep_for(trace, self.forwards_since_backward)
                            if trace is not None else None)
                if backward is not None:
                    keep = tuple(p for p in self.reuse_kept if backward.next_use(p, -1) is not None)
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
            guess = self.prediction.backward_guess(self.awaiting_backward_from, self.traces)
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
                self.awaiting_backward_from.forwards_per_backward = max(1, self.forwards_since_backward)
            self.awaiting_backward_from = None
            self.forwards_since_backward = 0
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
        if self.swap_ins is not None:
            self.stats.current.swap_in_unused += self.swap_ins.end_pass()
        self.stats.end_pass(aborted=aborted)
        self.phase = PassPhase.IDLE
        self.progress = None
        self.fetched_from.clear()

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

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def fetch_sub_module(self, current_submodule: Module, forward: bool) -> None:
        """Make the parameters of ``current_submodule`` available, then prefetch ahead in this pass."""
        # [Note: profiler ranges]
        with self.lock, module_range("fetch", current_submodule, " forward" if forward else " backward"):
            if (not forward or in_autograd_engine()) and self.phase is PassPhase.IDLE:
                self.begin_backward_pass()
            step = -1
            if self.progress is not None:
                step = self._observe(current_submodule)
            if self.check_ranks:
                kind = self.progress.kind if self.progress is not None else PassKind.FORWARD
                observed_step = self.progress.step if self.progress is not None else -1
                check_same_module_on_all_ranks(kind, observed_step, current_submodule, self.order_check.group)
            params = self._params_to_fetch(current_submodule, step)
            if self.phase is PassPhase.BACKWARD:
                self.active_backward[current_submodule.ds_id] = current_submodule
            for param in params:
                param.ds_active_sub_modules.add(current_submodule.ds_id)
            if self.swap_ins is not None:
                self._make_swap_room(params)
            self._gather(params, prefetch=False)
            with module_range("wait", current_submodule):
                if self.leaf_sharding.applies_to(current_submodule):
                    self.leaf_sharding.wait(self.gatherer, params)
                else:
                    self.gatherer.wait(params)
            if self.swap_ins is not None:
                persisted = persistent_partitions_in_memory(params)
                if persisted:  # gathered for good: their NVMe partition buffers are not needed again
                    persisted[0].nvme_swapper.remove_partition_and_release_buffers(persisted)
            for param in params:
                if param.ds_status != ZeroParamStatus.AVAILABLE:
                    raise RuntimeError(f"deepspeed-zero3: parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} "
                                       f"of module {type(current_submodule).__name__} ds_id={current_submodule.ds_id} "
                                       f"is {param.ds_status.name} after its fetch at step {step}; expected AVAILABLE")
            self._prefetch(step, current_submodule)
            if self.param_layout is not None:
                self.param_layout.after_fetch(current_submodule)

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def complete_gather(self, param: Parameter) -> None:
        """Finish the prefetch of ``param`` for a read outside its module's fetch ([Note: a parameter read while
        in flight], ordered_dict.py)."""
        with self.lock:
            self.gatherer.wait([param])
            if param.ds_status != ZeroParamStatus.AVAILABLE:
                raise RuntimeError(f"deepspeed-zero3: parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} "
                                   f"is {param.ds_status.name} after completing its gather; expected AVAILABLE")

    def _params_to_fetch(self, module: Module, step: int) -> Sequence[Parameter]:
        """``fetch_params(module)``, from the replayed trace when it holds them ([Note: cached parameter lists])."""
        progress = self.progress
        if progress is not None and progress.trace is not None:
            params = progress.trace.params_at(step, module)
            if params is not None:
                self.fetched_from[module.ds_id] = params
                return params
        self.fetched_from.pop(module.ds_id, None)
        return fetch_params(module)

    def _params_to_release(self, module: Module) -> Sequence[Parameter]:
        """What ``module``'s fetch covered: the list that fetch took from the trace, else
        ``fetch_params(module, strict=False)``."""
        params = self.fetched_from.get(module.ds_id)
        if params is not None and "_external_params" not in module.__dict__:
            return params
        # External parameters can be registered during the module's own forward (ZeROOrderedDict's getter):
        # its release covers them, as upstream's does.
        return fetch_params(module, strict=False)

    def _observe(self, module: Module) -> int:
        outcome = self.progress.observe(module)
        step = self.progress.trace_step
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

    def _prefetch(self, step: int, module: Optional[Module] = None) -> None:
        """Issue the gathers the prefetcher plans now; ``module`` (None when priming a pass) names the range."""
        prefetcher = self.current_prefetcher()
        if prefetcher is None:
            return
        prefetcher.reached(step)
        wanted = prefetcher.plan(self.live_numel, self.settings.max_live_numel, is_persistent=_is_persistent,
                                 stop_at=blocks_gather if self.swap_ins is not None else None)
        if wanted:
            with (module_range("prefetch", module, params=wanted)
                  if module is not None else pass_range("prefetch", " " + prefetcher.role + " start", wanted)):
                self._gather(wanted, prefetch=True)
        if self.swap_ins is not None:
            self.stats.current.swap_in_ahead += self.swap_ins.read_ahead(prefetcher.trace.param_uses,
                                                                         prefetcher.cursor, self.settings.bucket_numel)

    def _make_swap_room(self, params) -> None:
        """A demand fetch reads partitions from NVMe synchronously: count them, and free buffers for them."""
        needed = [p for p in params if blocks_gather(p)]
        if not needed:
            return
        self.stats.current.swap_in_demand += len(needed)
        self.swap_ins.make_room(needed, self._release_gathered_for_swap_room)

    def _release_gathered_for_swap_room(self, count: int) -> None:
        """Free ``count`` swap buffers by releasing gathered parameters not in use (kept, then prefetched)."""
        prefetcher = self.current_prefetcher()
        candidates = list(self.reuse_kept) + (list(prefetcher.outstanding) if prefetcher is not None else [])
        for param in candidates:
            if count <= 0:
                return
            if (on_nvme(param) and param.ds_status != ZeroParamStatus.NOT_AVAILABLE and not param.ds_active_sub_modules
                    and not held_by_gathered_parameters(param)):
                self._release(param)
                count -= 1

    def _gather(self, params: Iterable[Parameter], prefetch: bool) -> None:
        for group in self.gatherer.submit(params):
            self.stats.on_allgather(sum(p.ds_numel for p in group), prefetch=prefetch)
            for param in group:
                if not param.ds_persist and param not in self.live:
                    self.live[param] = None
                    self.stats.on_live_change(param.ds_numel)

    @eager_only  # [Note: what Dynamo may trace]
    @torch.no_grad()
    def release_sub_module(self, submodule: Module, forward: bool = False) -> None:
        """Release what ``submodule`` used, unless it is in use, claimed ahead, or reused soon."""
        with self.lock, module_range("release", submodule, " forward" if forward else " backward"):
            if forward and self.phase is PassPhase.BACKWARD and submodule.ds_id in self.active_backward:
                # A non-reentrant checkpoint recomputes this module's forward inside its own backward (and
                # torch's early stop raises out of it, which always_call forward hooks see): the backward has
                # yet to use the parameters (its AccumulateGrad included); its post-backward releases them.
                return
            step = self.progress.trace_step if self.progress is not None else -1
            prefetcher = self.current_prefetcher()
            partition = self.leaf_sharding.releaser() if self.leaf_sharding.applies_to(submodule) else None
            for param in self._params_to_release(submodule):
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
        """Whether ``param`` stays gathered: kept for the backward ([Note: budgeted keeping]), or its next use in
        this pass is within the reuse distance."""
        if self.progress is None or not self.progress.replaying():
            return False
        trace = self.progress.trace
        if self.progress.kind is PassKind.FORWARD and self.keeping.keeps(
                param, step, trace, self.prediction.backward_to_keep_for(trace, self.forwards_since_backward),
                self.settings):
            return True  # at reuse 0 too: what the backward's first window gathers again
        limit = self.settings.max_reuse_numel
        if limit == 0 or self.live_numel > self.settings.max_live_numel:
            return False
        next_step = trace.next_use(param, step)
        return next_step is not None and trace.numel_between(step + 1, next_step) < limit

    def _release(self, param: Parameter, partition=None) -> None:
        """``partition``: how to partition it, if not as ``param.partition()`` does (fast leaf sharding)."""
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
            (partition or release_gathered)(param)  # [Note: releasing a gathered parameter]
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

    @eager_only  # [Note: what Dynamo may trace]
    def reset_step(self, abandoning: bool = False) -> None:
        """End whatever pass is running and release everything gathered (upstream's end-of-step call)."""
        with self.lock:
            self._end_open_pass(abandoning)
            self.root_depth = 0
            if abandoning:
                # The abandoned forwards never reach a backward: the next forward is the first of its step
                # again, and keeps for its backward ([Note: budgeted keeping]).
                self.forwards_since_backward = 0

    @eager_only  # [Note: what Dynamo may trace]
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


# ---------------------------------------------------------------- upstream's module-level helpers
# ([Note: upstream's module names])

# Upstream's switch for its PartitionedParameterProfiler (event timings). Ours has no such profiler.
ENABLE_PROFILER = False
PROFILER_NOT_SUPPORTED = (
    "partitioned_param_coordinator.ENABLE_PROFILER=True asks for upstream's PartitionedParameterProfiler, which "
    "deepspeed-zero3 does not have; read the per-pass counters with deepspeed_zero3.get_zero3_stats(engine) or "
    "log them every N steps with DEEPSPEED_ZERO3_STATS_EVERY=N, or set DEEPSPEED_ZERO3=0 to run upstream's runtime")


def debug_rank0(message: str) -> None:
    if dist.get_rank() == 0:
        logger.debug(message)


def get_all_parameters(sub_module: Module, recurse: bool = False):
    """``(name, parameter)`` pairs one fetch of ``sub_module`` covers: its own, then its external ones."""
    return named_fetch_params(sub_module, recurse)


class ZeRoTraceMode(Enum):
    """Upstream's trace states. Ours keeps a trace per pass (trace.py); a coordinator answers
    ``is_record_trace()``, ``is_complete_trace()`` and ``is_invalid_trace()`` for the pass running."""
    RECORD = 1
    COMPLETE = 2
    INVALID = 3


def update_recompute_parameters(sub_module: Module, param: Parameter) -> None:
    """Upstream ties a frozen parameter gathered while a checkpoint recomputes to the backward module
    running, for its release. Ours has no such tie to update (see the error)."""
    raise NotImplementedError(
        f"update_recompute_parameters({type(sub_module).__name__} ds_id={getattr(sub_module, 'ds_id', None)}, "
        f"param ds_id={getattr(param, 'ds_id', None)}) is upstream's bookkeeping for parameters gathered while a "
        f"checkpoint recomputes, which deepspeed-zero3 does not keep: release_sub_module() decides when a "
        f"parameter fetched in a backward pass is released, and release_backward_leftovers() releases what is "
        f"still gathered when the backward ends. Use PartitionedParameterCoordinator.fetch_sub_module() and "
        f"release_sub_module(), or set DEEPSPEED_ZERO3=0 to run upstream's runtime.")
