"""ZeRO-3 parameter management for one engine (served as upstream's
``deepspeed.runtime.zero.parameter_offload``).

``DeepSpeedZeRoOffload`` converts the module's parameters to ZeRO parameters,
then joins (or creates) the module tree's ``ParamStateRegistry``, which owns the
hooks and the coordinator. Several engines over one module share that state
([Note: sharing one module tree] in ``param_registry.py``).

What differs from upstream's module:

* Hooks, traces and the coordinator belong to the module tree's registry, not
  to this object; its hook lists are views of the registry's live handles.
* Every module-level name of upstream's module exists here, re-exported from
  ``upstream_names.py`` ([Note: upstream's module names]); ``ZeROOrderedDict``'s
  getter announces a gather through this module's ``print_rank_0``, as
  upstream's does.
"""

from deepspeed_zero3.runtime.zero.upstream_names import *  # noqa: F401,F403  [Note: upstream's module names]
from deepspeed_zero3.runtime.zero.upstream_names import _init_external_params  # noqa: F401

import functools
import inspect
import sys

import torch

from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.partition_parameters import Init
from deepspeed.runtime.zero.utils import is_zero_param

from deepspeed_zero3.runtime.zero import capabilities
from deepspeed_zero3.runtime.zero.gather import InflightParamRegistry
from deepspeed_zero3.runtime.zero.hooks import FWD_MODULE_STACK, handle_is_live, pop_forward_module
from deepspeed_zero3.runtime.zero.leaf_granularity import apply_granularity_threshold, check_granularity_threshold
from deepspeed_zero3.runtime.zero.module_params import iter_params  # noqa: F401 (upstream imports it from the coordinator)
from deepspeed_zero3.runtime.zero.ordered_dict import ZeROOrderedDict, ensure_zero_ordered_dict, inject_zero_ordered_dicts
from deepspeed_zero3.runtime.zero.param_registry import ParamStateRegistry, find_registry
from deepspeed_zero3.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed_zero3.runtime.zero.settings import PrefetchSettings, reject_boolean_numels
from deepspeed_zero3.runtime.zero.zenflow_params import ZenFlowParamLayout, check_zenflow_params


def _apply_forward_and_backward_to_tensors_only(module, forward_function, backward_function, outputs):
    """Call ``forward_function`` on each tensor of ``outputs`` (tuples searched recursively) and register
    ``backward_function`` as the gradient hook of those that require grad; ``outputs`` is returned as is.

    Upstream's output helper, for callers of its name: our own output wrapping is ``HookRouter`` in ``hooks.py``.
    Like upstream's, it looks into plain tuples only and at exact ``torch.Tensor`` objects.
    """
    if type(outputs) is tuple:
        return tuple(
            _apply_forward_and_backward_to_tensors_only(module, forward_function, backward_function, item)
            for item in outputs)
    if type(outputs) is torch.Tensor:
        forward_function(outputs)
        if outputs.requires_grad:
            outputs.register_hook(backward_function)
    return outputs


def _inject_parameters(module, cls):
    """Give every module under ``module`` a ``_parameters`` container of class ``cls``, keeping the old one as
    ``_original_parameters`` (upstream's name).

    For ``ZeROOrderedDict`` this is ``inject_zero_ordered_dicts``: idempotent, and the container kept is the
    one from before the first wrap, so un-injection restores the module's own. Any other class is built with
    no arguments and filled in order, as upstream does.
    """
    if cls is ZeROOrderedDict:
        inject_zero_ordered_dicts(module)
        return
    for submodule in module.modules():
        container = cls()
        for key, param in submodule._parameters.items():
            container[key] = param
        submodule._original_parameters = submodule._parameters
        submodule._parameters = container


def without_argument(function, name):
    """``function`` with its argument ``name`` removed from the signature (it takes its default)."""
    signature = inspect.signature(function)
    reduced = signature.replace(parameters=[p for p in signature.parameters.values() if p.name != name])

    @functools.wraps(function)
    def call(*args, **kwargs):
        return function(**reduced.bind(*args, **kwargs).arguments)

    call.__signature__ = reduced
    return call


def _group_ranks(group):
    """The global ranks of a process group (None: the whole world), comparable between engines."""
    import torch.distributed as torch_dist
    if not torch_dist.is_initialized():
        return None
    if group is None:
        return tuple(range(torch_dist.get_world_size()))
    try:
        return tuple(torch_dist.get_process_group_ranks(group))
    except Exception:  # a group object torch does not know; identity is the best we can compare
        return f"group object {id(group):#x}"


class DeepSpeedZeRoOffload:
    """Upstream's constructor signature and attributes; the hooks and coordinator come from the registry."""

    def __init__(
        self,
        module,
        timers,
        ds_config,
        zenflow=False,
        overlap_comm=True,
        prefetch_bucket_size=50000000,
        max_reuse_distance=1000000000,
        max_live_parameters=1000000000,
        param_persistence_threshold=100000,
        model_persistence_threshold=sys.maxsize,
        dp_process_group=None,
        offload_param_config=None,
        mpu=None,
        zero_param_parallel_group=None,
        zero_quantized_weights=False,
        zero_quantized_nontrainable_weights=False,
        zero_module_granularity_threshold=0,
        log_trace_cache_warnings=False,
    ):
        reject_boolean_numels(ds_config)  # [Note: booleans in the raw config]
        zero_module_granularity_threshold = check_granularity_threshold(zero_module_granularity_threshold or 0)
        self.settings = PrefetchSettings.from_config_values(prefetch_bucket_size, max_live_parameters,
                                                            max_reuse_distance)
        self.module = module
        self.timers = timers
        self.zenflow = zenflow
        self.dtype = list(module.parameters())[0].dtype
        self.dp_process_group = dp_process_group
        self.offload_device = None
        self.offload_param_pin_memory = False
        self.zero_param_parallel_group = zero_param_parallel_group
        self.zero_quantized_weights = zero_quantized_weights
        self.zero_quantized_nontrainable_weights = zero_quantized_nontrainable_weights
        self.log_trace_cache_warnings = log_trace_cache_warnings
        self.zero_module_granularity_threshold = zero_module_granularity_threshold
        # Upstream's meaning: any threshold turns on fast sharding of z3 leaves ([Note: fast sharding for leaf modules]),
        # on a release that has it ([Note: release capabilities]).
        self.fast_sharding_for_leaf_module = zero_module_granularity_threshold > 0 and capabilities.FAST_LEAF_SHARDING
        if offload_param_config is not None and offload_param_config.device != OffloadDeviceEnum.none:
            self.offload_device = offload_param_config.device
            self.offload_param_pin_memory = offload_param_config.pin_memory

        self.param_numel_persistence_threshold = int(param_persistence_threshold)
        self.model_persistence_threshold = int(model_persistence_threshold)
        self._prefetch_bucket_sz = self.settings.bucket_numel
        self._max_reuse_distance_in_numel = self.settings.max_reuse_numel
        self._max_available_parameters_in_numel = self.settings.max_live_numel

        registry = find_registry(module)
        fixed = self._fixed_settings()
        if registry is not None:
            registry.check_fixed_settings(fixed)

        self._convert_to_zero_parameters(ds_config, module, mpu)
        for submodule in module.modules():
            _init_external_params(submodule)
        inject_zero_ordered_dicts(module)
        self.persistent_parameters = self.mark_persistent_parameters(self.param_numel_persistence_threshold,
                                                                     self.model_persistence_threshold)
        if zenflow:
            check_zenflow_params(module.named_parameters())
        if zero_module_granularity_threshold > 0:
            # Before the tree is numbered, as upstream: numbering stops at z3 leaves ([Note: module granularity]).
            selection = apply_granularity_threshold(module, zero_module_granularity_threshold)
            self.z3_leaf_layers = selection.leaves
            self.min_granularity_value = selection.smallest_value
            self.min_granularity_layer = selection.smallest_class

        if registry is None:
            coordinator = PartitionedParameterCoordinator(
                prefetch_bucket_sz=self.settings.bucket_numel,
                max_reuse_distance_in_numel=self.settings.max_reuse_numel,
                max_available_parameters_in_numel=self.settings.max_live_numel,
                allgather_stream=self._make_allgather_stream(overlap_comm),
                inflight_param_registry=InflightParamRegistry(),
                prefetch_nvme=self.offload_device == OffloadDeviceEnum.nvme,
                timers=timers,
                zero_quantized_weights=zero_quantized_weights,
                zero_quantized_nontrainable_weights=zero_quantized_nontrainable_weights,
                log_trace_cache_warnings=log_trace_cache_warnings,
                data_parallel_group=dp_process_group,
                fast_sharding_for_leaf_module=self.fast_sharding_for_leaf_module,
            )
            if zenflow:
                coordinator.param_layout = ZenFlowParamLayout()
            registry = ParamStateRegistry(coordinator, fixed)
        self.registry = registry
        self.param_coordinator = registry.coordinator
        # Upstream keeps the in-flight registry on the module; callers may look for it there.
        module.ds_inflight_param_registry = registry.coordinator.inflight
        self.setup_zero_stage3_hooks()
        registry.add_owner(self, self.settings)

    # ---------------------------------------------------------------- construction helpers

    if not capabilities.ZENFLOW:
        # [Note: release capabilities] Before ZenFlow the 4th argument is overlap_comm: a positional call of that
        # release must bind as it does there.
        __init__ = without_argument(__init__, "zenflow")

    def _fixed_settings(self):
        return {
            "data-parallel group ranks": _group_ranks(self.dp_process_group),
            "dtype": self.dtype,
            "stage3_param_persistence_threshold": int(self.param_numel_persistence_threshold),
            "stage3_model_persistence_threshold": int(self.model_persistence_threshold),
            # Both change how every module of the tree is fetched (its leaves, its parameters' layout).
            "stage3_module_granularity_threshold": self.zero_module_granularity_threshold,
            "zenflow": bool(self.zenflow),
        }

    @staticmethod
    def _make_allgather_stream(overlap_comm):
        accelerator = get_accelerator()
        if accelerator.is_synchronized_device():
            return None
        return accelerator.Stream() if overlap_comm else accelerator.default_stream()

    def _convert_to_zero_parameters(self, ds_config, module, mpu):
        plain = [p for p in module.parameters() if not is_zero_param(p)]
        if not plain:
            return
        converted = [p for p in module.parameters() if is_zero_param(p)]
        if converted:
            converted[0].convert_to_zero_parameters(param_list=plain)
            return
        group = None
        if mpu is not None and hasattr(mpu, "get_data_parallel_group"):
            group = mpu.get_data_parallel_group()
        converter = Init(module=module,
                         data_parallel_group=group,
                         dtype=self.dtype,
                         config_dict_or_path=ds_config,
                         remote_device=self.offload_device,
                         pin_memory=self.offload_param_pin_memory,
                         mpu=mpu,
                         zero_param_parallel_group=self.zero_param_parallel_group,
                         zero_quantized_weights=self.zero_quantized_weights,
                         zero_quantized_nontrainable_weights=self.zero_quantized_nontrainable_weights)
        # NOTE: every converted parameter keeps this Init object alive (its gather methods are bound to it),
        # and Init stores the module it converted without reading it again. Dropping that reference lets a
        # wrapper module, and the engine whose hooks sit on it, be collected (Lightning drops engines).
        converter.module = None

    def mark_persistent_parameters(self, param_threshold, model_threshold):
        """Small parameters stay gathered: each up to ``param_threshold`` numel, all of them up to ``model_threshold``."""
        persistent = []
        total = 0
        for _, param in self.module.named_parameters(recurse=True):
            if param.ds_numel + total > model_threshold:
                continue
            if param.ds_numel <= param_threshold:
                param.ds_persist = True
                persistent.append(param)
                total += param.ds_numel
        return persistent

    # ---------------------------------------------------------------- hooks (owned by the registry)

    def setup_zero_stage3_hooks(self):
        self.hierarchy = 0
        self._register_deepspeed_module(self.module)

    def _register_deepspeed_module(self, module, count=None):
        """Hook ``module``'s tree (idempotent: puts back hooks that were removed, e.g. for generation)."""
        self.registry.adopt_tree(module)

    # Its name before 0.16.4, which stage 3 and client libraries (TRL's add_hooks) call on those releases.
    _register_hooks_recursively = _register_deepspeed_module

    @property
    def forward_hooks(self):
        # Live handles only: upstream's unwrap_model_for_generation removes them and checks the list is empty.
        return [h for hooks in self.registry.module_hooks.values() for h in hooks.forward if handle_is_live(h)]

    @forward_hooks.setter
    def forward_hooks(self, handles):
        # Upstream callers empty this list after removing the hooks themselves; nothing to keep.
        pass

    @property
    def backward_hooks(self):
        return [h for hooks in self.registry.module_hooks.values() for h in hooks.backward if handle_is_live(h)]

    @backward_hooks.setter
    def backward_hooks(self, handles):
        pass

    @property
    def fwd_pre_hook(self):
        return self.registry.root_hooks.get(self.module, (None, ))[0]

    def _remove_module_hooks(self):
        """Remove every ZeRO-3 hook of the module tree (DeepCompile takes over the fetching)."""
        self.registry.remove_all_hooks()

    def destroy(self):
        """Drop this engine's ownership; the last owner's destroy removes the hooks."""
        registry = self.__dict__.get("registry")
        if registry is not None:
            registry.drop_owner(self)

    # ---------------------------------------------------------------- upstream's entry points

    def get_param_coordinator(self):
        return self.param_coordinator

    @torch.no_grad()
    def partition_all_parameters(self):
        """Release every gathered parameter of the module (stage 3 calls this in step())."""
        self.param_coordinator.release_and_reset_all(self.module)

    def release_backward_leftovers(self):
        """End of engine.backward(): close the backward pass."""
        self.param_coordinator.release_backward_leftovers()

    def empty_partition_cache(self):
        self.partition_all_parameters()

    @torch.no_grad()
    def pre_sub_module_forward_function(self, sub_module):
        FWD_MODULE_STACK.append(sub_module)
        self.param_coordinator.fetch_sub_module(sub_module, forward=True)

    @torch.no_grad()
    def post_sub_module_forward_function(self, sub_module):
        pop_forward_module(sub_module)
        self.param_coordinator.release_sub_module(sub_module, forward=True)

    @torch.no_grad()
    def pre_sub_module_backward_function(self, sub_module):
        self.param_coordinator.fetch_sub_module(sub_module, forward=False)

    @torch.no_grad()
    def post_sub_module_backward_function(self, sub_module):
        self.param_coordinator.release_sub_module(sub_module, forward=False)
