"""``deepspeed_zero3.iter_gathered_parameters``: full weights out of a ZeRO-3 model, for a weight sync or an export.

    for name, tensor in deepspeed_zero3.iter_gathered_parameters(engine):   # every rank, in lockstep
        if rank == 0:
            inference_engine.load_weights([(name, tensor)])

The stream ([Note: streaming weights] in ``runtime/zero/weight_stream.py``) also offers ``metadata()`` (names,
dtypes, shapes, gathering nothing), ``groups()`` and ``iter_groups()`` (one ``(names, tensors)`` per bucket),
``stats`` and ``close()``; it is a context manager.

Every rank iterates, each bucket being a collective. A consumer that works on rank 0 only must not raise there
alone: the other ranks would wait in the next bucket's all-gather until the process-group timeout. Catch on
rank 0 and agree on stopping (or let every rank raise together).
"""

import difflib
from typing import Iterable, List, Optional

from torch.nn import Module

from deepspeed_zero3.runtime.zero.weight_stream import StreamUnit, TensorMeta, WeightStream


def iter_gathered_parameters(model_or_engine, bucket_numel: Optional[int] = None, names: Optional[Iterable[str]] = None,
                             merge_adapters: bool = False) -> WeightStream:
    """A stream of ``(name, full tensor)`` over the parameters of a ZeRO-3 model (or the selected ``names``).

    ``bucket_numel``: numel gathered per coalesced all-gather (default: the engine's
    ``stage3_prefetch_bucket_size``; 0: one parameter at a time; a whole float such as ``5e7`` is taken, as the
    config takes it). ``names``: the parameter names to stream, as ``named_parameters()`` gives them, in the
    model's order whatever the order given; an unknown name is refused with the closest known ones.
    A parameter that is not partitioned (a module attached after ``initialize``) is yielded as it is, gathering
    nothing. Buffers are not parameters and are not yielded; a tied parameter is yielded once, under its first
    name. Use each tensor (copy, broadcast, load) before the loop moves on, where the stream may release it;
    work queued on another CUDA stream must be synchronized first. ``merge_adapters=True`` on a peft model yields
    the base weights with the active LoRA adapters merged in, named as ``merge_and_unload()`` names them, gathering
    one LoRA layer at a time; the adapters themselves are not changed.
    """
    module = _module_of(model_or_engine)
    coordinator = _coordinator_of(module)
    if bucket_numel is None:
        bucket_numel = coordinator.settings.bucket_numel
    bucket_numel = _check_bucket(bucket_numel)
    if merge_adapters:
        from deepspeed_zero3.peft_merge import merged_units
        units = merged_units(module)
    else:
        units = [_plain_unit(name, param) if hasattr(param, "ds_id") else _unpartitioned_unit(name, param)
                 for name, param in module.named_parameters()]
    if names is not None:
        units = _select(units, names)
    return WeightStream(coordinator.gatherer, coordinator.residency, coordinator.lock, coordinator.running_kind,
                        units, bucket_numel)


def stream_module(target, api: str = "iter_gathered_parameters") -> Module:
    """The module a stream (or a save, or the local shards) reads: the engine's, or ``target`` itself; ``api`` names
    the caller in the error for anything else."""
    return _module_of(target, api)


def _module_of(target, api: str = "iter_gathered_parameters") -> Module:
    from deepspeed.runtime.engine import DeepSpeedEngine

    if isinstance(target, DeepSpeedEngine):
        return target.module
    if isinstance(target, Module):
        return target
    raise TypeError(f"{api} expects the engine deepspeed.initialize returned, or its model (an nn.Module); got "
                    f"{type(target).__name__}")


def _coordinator_of(module: Module):
    from deepspeed_zero3.runtime.zero.registry_lookup import find_registry

    named = list(module.named_parameters())
    if named and not any(hasattr(param, "ds_id") for _, param in named):
        raise ValueError(f"iter_gathered_parameters expects a ZeRO-3 model: parameter {named[0][0]!r} of "
                         f"{type(module).__name__} is not partitioned (no ds_id), nor is any other. Pass the model "
                         f"after deepspeed.initialize with zero_optimization.stage 3, or the engine itself.")
    registry = find_registry(module)
    if registry is None:
        raise ValueError(f"iter_gathered_parameters: no deepspeed-zero3 engine manages this "
                         f"{type(module).__name__} (its ZeRO-3 parameters were partitioned without our runtime, or "
                         f"every engine over it was destroyed). Is the overlay active? Run `python -m deepspeed_zero3`.")
    return registry.coordinator


def _check_bucket(value) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"iter_gathered_parameters: bucket_numel={value!r} is not allowed: expected a whole number of "
                         f"parameters >= 0 (0 gathers one parameter at a time), or None for the engine's "
                         f"stage3_prefetch_bucket_size")
    return value


def _plain_unit(name: str, param) -> StreamUnit:
    return StreamUnit(params=(param, ), produce=lambda: [(name, param.detach())],
                      meta=(TensorMeta(name, param.dtype, tuple(param.ds_shape)), ))


def _unpartitioned_unit(name: str, param) -> StreamUnit:
    return StreamUnit(params=(), produce=lambda: [(name, param.detach())],
                      meta=(TensorMeta(name, param.dtype, tuple(param.shape)), ))


def _select(units: List[StreamUnit], names: Iterable[str]) -> List[StreamUnit]:
    if isinstance(names, str):
        raise TypeError(f"iter_gathered_parameters: names={names!r} is one string; pass a list of parameter names")
    wanted = list(names)
    known = {meta.name for unit in units for meta in unit.meta}
    unknown = [name for name in wanted if name not in known]
    if unknown:
        hints = []
        for name in unknown[:5]:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ValueError(f"iter_gathered_parameters: {len(unknown)} name(s) not in the model: {', '.join(hints)}"
                         f"{' ...' if len(unknown) > 5 else ''}; the model has {len(known)} parameters")
    chosen = set(wanted)
    selected = []
    for unit in units:
        kept = tuple(meta for meta in unit.meta if meta.name in chosen)
        if not kept:
            continue
        if len(kept) == len(unit.meta):
            selected.append(unit)
            continue
        names_kept = {meta.name for meta in kept}
        produce = unit.produce
        selected.append(StreamUnit(unit.params, lambda produce=produce, names_kept=names_kept: [
            pair for pair in produce() if pair[0] in names_kept], kept))
    return selected
