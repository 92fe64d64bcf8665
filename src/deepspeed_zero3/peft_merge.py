"""``iter_gathered_parameters(peft_model, merge_adapters=True)``: the base weights with LoRA merged in, one layer at a time.

peft's ``merge_and_unload()`` under ZeRO-3 needs the whole model gathered. Here each LoRA layer is one stream unit:
its base layer's and adapters' parameters are gathered together, and the merged weight is a new tensor computed
with peft's own ``get_delta_weight`` the way peft's merge adds it (``weight += delta`` per active adapter, then the
LoRA bias; an embedding's delta cast to its dtype first), so it is bitwise what ``merge_and_unload()`` gives on the
gathered model; the model is not changed.
Names are those of ``merge_and_unload()``'s result: the base model's, without ``base_layer``, without adapters, and a
``modules_to_save`` copy under its original module's name. Covered: ``lora.Linear``, ``lora.Embedding`` and
``modules_to_save``; refused with a clear error: other peft layers (convolutions, MultiheadAttention, trainable
tokens), adapter variants (DoRA: their merge is not a sum of deltas) and a LoRA base weight tied to one streamed
earlier (its merge changes both names).
"""

from typing import List, Optional

import torch
from torch.nn import Module

from deepspeed_zero3.runtime.zero.weight_stream import StreamUnit, TensorMeta


def _base_model(model: Module) -> Module:
    """What ``merge_and_unload()`` returns the merged version of: the model inside the LoRA tuner."""
    try:
        from peft import PeftModel
        from peft.tuners.lora import LoraModel
    except ImportError:
        PeftModel = LoraModel = ()  # peft is not installed: no model is a peft model
    if PeftModel and isinstance(model, PeftModel):
        model = model.base_model
    if LoraModel and isinstance(model, LoraModel):
        return model.model
    raise ValueError(f"iter_gathered_parameters(merge_adapters=True) expects a peft LoRA model (PeftModel or "
                     f"LoraModel), or the engine over one; got {type(model).__name__}")


def _merge_unit(prefix: str, layer, seen: set) -> StreamUnit:
    """One LoRA layer: its base weights with its active adapters added the way peft's (unsafe) merge adds them."""
    from peft.tuners.lora import layer as lora

    kind = type(layer)
    if kind is lora.Embedding:
        adapter_keys = layer.lora_embedding_A  # peft keeps an embedding's adapters there, not in lora_A
    elif kind is lora.Linear:
        adapter_keys = layer.lora_A
    else:
        raise ValueError(f"iter_gathered_parameters(merge_adapters=True): LoRA layer {prefix.rstrip('.')!r} is a "
                         f"{kind.__name__}; merging is supported for lora.Linear and lora.Embedding. Stream it "
                         f"without merge_adapters, or merge it with peft on a gathered model")
    adapters = [a for a in layer.active_adapters if a in adapter_keys and a not in layer.merged_adapters]
    variants = [a for a in adapters if a in getattr(layer, "lora_variant", {})]
    if variants:
        raise ValueError(f"iter_gathered_parameters(merge_adapters=True): LoRA layer {prefix.rstrip('.')!r} uses an "
                         f"adapter variant for {variants} (DoRA or similar), whose merge is not a sum of deltas; "
                         f"stream it without merge_adapters, or merge it with peft on a gathered model")
    base = layer.get_base_layer()
    own = list(base.named_parameters(recurse=False))
    shared = [name for name, param in own if id(param) in seen]
    if shared:
        raise ValueError(f"iter_gathered_parameters(merge_adapters=True): the base {shared} of LoRA layer "
                         f"{prefix.rstrip('.')!r} is tied to a parameter streamed before it; merge_and_unload() "
                         f"would change both names, which a layer-by-layer merge cannot. Untie it, or stream without "
                         f"merge_adapters")
    seen.update(id(param) for _, param in own)
    biased = [a for a in adapters if kind is lora.Linear and layer.lora_bias[a]]
    if biased and getattr(base, "bias", None) is None:
        raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the base layer has no bias.")

    @torch.no_grad()
    def produce():
        merged = {name: param.detach().clone() for name, param in own}
        for adapter in adapters:
            if kind is lora.Embedding:
                merged["weight"] += layer.get_delta_weight(adapter).to(merged["weight"].dtype)
                continue
            merged["weight"] += layer.get_delta_weight(adapter)
            if adapter in biased:
                merged["bias"] += layer.lora_B[adapter].bias * layer.scaling[adapter]
        return [(f"{prefix}{name}", tensor) for name, tensor in merged.items()]

    return StreamUnit(params=tuple(layer.parameters()), produce=produce,
                      meta=tuple(TensorMeta(f"{prefix}{n}", p.dtype, tuple(p.ds_shape)) for n, p in own))


def merged_units(model: Module) -> List[StreamUnit]:
    base = _base_model(model)  # first: without peft installed no model is a peft model, and that is the error
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper
    from peft.utils.other import AuxiliaryTrainingWrapper

    units: List[StreamUnit] = []
    seen = set()
    found_lora = False

    def walk(module: Module, prefix: str, source: Optional[Module] = None):
        nonlocal found_lora
        if isinstance(module, LoraLayer):
            found_lora = True
            units.append(_merge_unit(prefix, module, seen))
            return
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapters[0] if module.active_adapters else None
            replacement = module.modules_to_save[active] if active in module.modules_to_save else module.original_module
            walk(replacement, prefix)
            return
        if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            raise ValueError(f"iter_gathered_parameters(merge_adapters=True): {prefix.rstrip('.') or 'the model'} is a "
                             f"peft {type(module).__name__}, which this merge does not cover (lora.Linear, "
                             f"lora.Embedding and modules_to_save are); stream without merge_adapters")
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue  # a tied parameter: once, under its first name, as named_parameters() gives it
            seen.add(id(param))
            full = f"{prefix}{name}"
            units.append(StreamUnit(params=(param, ), produce=lambda full=full, param=param: [(full, param.detach())],
                                    meta=(TensorMeta(full, param.dtype, tuple(param.ds_shape)), )))
        for name, child in module.named_children():
            walk(child, f"{prefix}{name}.")

    walk(base, "")
    if not found_lora:
        raise ValueError(f"iter_gathered_parameters(merge_adapters=True): no LoRA layer in this "
                         f"{type(base).__name__}; call it without merge_adapters")
    return units
