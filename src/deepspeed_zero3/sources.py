"""``deepspeed_zero3.weight_source``: the weight stream in the shape of a trainer-side weight source, as vLLM's
weight-transfer engines pull from one.

    source = deepspeed_zero3.weight_source(engine)
    info = source.metadata()                      # [(name, dtype, full shape), ...]: nothing is gathered
    for name, tensor in source:                   # every trainer rank, in lockstep: each bucket is a collective
        ...                                       # a fresh stream each time: the source is re-iterable

A source is what a transfer engine asks for: first the metadata of every tensor (to allocate, or to send an update
request), then the tensors themselves, as often as it syncs. Iterating it runs one ``iter_gathered_parameters``
stream with the source's settings: buckets coalesced, the next in flight, at most two buckets and the largest
parameter gathered at once; ``stats`` is the last iteration's. Every trainer rank must iterate it alike, as with a
source over an FSDP model, whose tensors are gathered one at a time. Nothing here imports vLLM.
"""

from typing import Iterable, Iterator, List, Optional, Tuple

import torch


class WeightSource:
    """A re-iterable source of ``(name, full tensor)`` over a ZeRO-3 model (``weight_source``)."""

    def __init__(self, model_or_engine, bucket_numel: Optional[int], names: Optional[List[str]], merge_adapters: bool):
        from deepspeed_zero3.weights import iter_gathered_parameters

        self._open = lambda: iter_gathered_parameters(model_or_engine, bucket_numel=bucket_numel, names=names,
                                                      merge_adapters=merge_adapters)
        self._open()  # refuses bad input now, before any transfer begins; gathers nothing
        self.stats = None  # the last iteration's StreamStats

    def metadata(self) -> List[Tuple[str, torch.dtype, Tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of every tensor the source yields, in order; gathers nothing."""
        return [(meta.name, meta.dtype, meta.shape) for meta in self._open().metadata()]

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        stream = self._open()
        self.stats = stream.stats
        with stream:
            yield from stream


def weight_source(model_or_engine, bucket_numel: Optional[int] = None, names: Optional[Iterable[str]] = None,
                  merge_adapters: bool = False) -> WeightSource:
    """A ``WeightSource`` over a ZeRO-3 model or engine; the arguments are ``iter_gathered_parameters``' (see the
    module's docstring)."""
    return WeightSource(model_or_engine, bucket_numel, list(names) if names is not None else None, merge_adapters)
