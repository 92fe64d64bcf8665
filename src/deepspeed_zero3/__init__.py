"""deepspeed-zero3: a drop-in ZeRO-3 parameter runtime for upstream DeepSpeed.

Importing this package is cheap (no torch, no deepspeed): the activation hook
imports it at every interpreter start.
"""

__version__ = "0.1.0"

__all__ = ["__version__", "get_zero3_stats", "reset_zero3_stats", "abandon_step", "overlay_status",
           "iter_gathered_parameters", "WeightStream", "TensorMeta", "StreamStats",
           "save_16bit_model", "consolidated_16bit_state_dict", "RanksInDifferentPasses", "iter_local_shards",
           "LocalShard", "weight_source", "WeightSource", "WeightSender", "receive_weights"]


def __getattr__(name):
    # Lazy so that `import deepspeed_zero3` never pulls in torch.
    if name in ("get_zero3_stats", "reset_zero3_stats"):
        from deepspeed_zero3.runtime.zero import stats_api
        return getattr(stats_api, name)
    if name == "abandon_step":
        from deepspeed_zero3.runtime.zero.recovery import abandon_step
        return abandon_step
    if name == "iter_gathered_parameters":
        from deepspeed_zero3.weights import iter_gathered_parameters
        return iter_gathered_parameters
    if name in ("WeightStream", "TensorMeta", "StreamStats"):
        from deepspeed_zero3.runtime.zero import weight_stream
        return getattr(weight_stream, name)
    if name in ("save_16bit_model", "consolidated_16bit_state_dict"):
        from deepspeed_zero3 import save
        return getattr(save, name)
    if name == "RanksInDifferentPasses":
        from deepspeed_zero3.runtime.zero.pass_agreement import RanksInDifferentPasses
        return RanksInDifferentPasses
    if name in ("WeightSender", "receive_weights"):
        from deepspeed_zero3 import sender
        return getattr(sender, name)
    if name in ("weight_source", "WeightSource"):
        from deepspeed_zero3 import sources
        return getattr(sources, name)
    if name in ("iter_local_shards", "LocalShard"):
        from deepspeed_zero3 import local_shards
        return getattr(local_shards, name)
    if name == "overlay_status":
        from deepspeed_zero3.activation import overlay_status
        return overlay_status
    raise AttributeError(f"module 'deepspeed_zero3' has no attribute {name!r}")
