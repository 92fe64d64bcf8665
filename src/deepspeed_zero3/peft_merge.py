"""``iter_gathered_parameters(peft_model, merge_adapters=True)``: the base weights with LoRA merged in, one layer at a time.

peft's ``merge_and_unload()`` under ZeRO-3 needs the whole model gathered. Here each LoRA layer is one stream unit:
its base layer's and adapters' parameters are gathered together, and the merged weight is a new tensor computed
with peft's own ``get_delta_weight`` the way peft's merge adds it (``weight += delta`` per active adapter, then the
LoRA bias), so it is bitwise what ``merge_and_unload()`` gives on the gathered model; the model is not changed.
Names are those of ``merge_and_unload()``'s result: the base model's, without ``base_layer``, without adapters, and a
``modules_to_save`` copy under its original module's name. Adapter variants (DoRA and other ``lora_variant``) are
refused: their merge is not a sum of deltas.
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


def _merge_unit(prefix: str, layer) -> StreamUnit:
    adapters = [a for a in layer.active_adapters if a in layer.lora_A and a not in layer.merged_adapters]
    variants = [a for a in adapters if a in getattr(layer, "lora_variant", {})]
    if variants:
        raise ValueError(f"iter_gathered_parameters(merge_adapters=True): LoRA layer {prefix!r} uses an adapter "
                         f"variant for {variants} (DoRA or similar), whose merge is not a sum of deltas; stream it "
                         f"without merge_adapters, or merge it with peft on a gathered model")
    base = layer.get_base_layer()
    own = list(base.named_parameters(recurse=False))

    @torch.no_grad()
    def produce():
        merged = {name: param.detach().clone() for name, param in own}
        for adapter in adapters:
            merged["weight"] += layer.get_delta_weight(adapter)
            if layer.lora_bias[adapter]:
                merged["bias"] += layer.lora_B[adapter].bias * layer.scaling[adapter]
        return [(f"{prefix}{name}", tensor) for name, tensor in merged.items()]

    return StreamUnit(params=tuple(layer.parameters()), produce=produce,
                      meta=tuple(TensorMeta(f"{prefix}{n}", p.dtype, tuple(p.ds_shape)) for n, p in own))


def merged_units(model: Module) -> List[StreamUnit]:
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    base = _base_model(model)
    units: List[StreamUnit] = []
    seen = set()
    found_lora = False

    def walk(module: Module, prefix: str, source: Optional[Module] = None):
        nonlocal found_lora
        if isinstance(module, LoraLayer):
            found_lora = True
            units.append(_merge_unit(prefix, module))
            return
        if isinstance(module, ModulesToSaveWrapper):
            active = module.active_adapters[0] if module.active_adapters else None
            replacement = module.modules_to_save[active] if active in module.modules_to_save else module.original_module
            walk(replacement, prefix)
            return
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
