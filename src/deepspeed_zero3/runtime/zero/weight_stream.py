"""Streaming full weights out of a ZeRO-3 model: coalesced gathers, one bucket in flight ahead of the consumer.

[Note: streaming weights]
A weight sync gathers every parameter once, in order, on every rank. One collective per
tensor, and nothing in flight while the consumer works, are what make it slow.
* Rule: units (a parameter, or what one merged output needs) are cut into buckets of at most
  ``bucket_numel`` numel to gather (a larger unit alone; on NVMe, at most ``buffer_count``
  partitions read). Bucket i+1's all-gather is issued before the consumer gets bucket i, while
  both fit in 2 x bucket + the largest unit (and the swap buffers are free); bucket i is
  released when the consumer moves past it. So the stream's peak stays under that bound.
* A parameter already gathered (persistent, kept, inside the caller's ``GatheredParameters``)
  is yielded as it is and never released by the stream.
* It uses the runtime's gather path (the all-gather stream, its back-pressure, the coordinator's
  lock), and its parameters are held in the residency for the stream (reason STREAM, [Note:
  residency]): marked as ``GatheredParameters`` marks its own, so no pass releases them, outside
  ``live_numel``. It refuses to start while a pass runs. Leaving early
  completes what is in flight and releases all it gathered. Every rank must iterate alike: each
  bucket is a collective, and a rank that stops alone stops the others after that bucket
  ([Note: a stream stops together]).
"""

from dataclasses import dataclass, field
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.nn import Parameter

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.gather import Gatherer
from deepspeed_zero3.runtime.zero.nvme_swap import blocks_gather, on_nvme
from deepspeed_zero3.runtime.zero.residency import Residency
from deepspeed_zero3.runtime.zero.stream_lockstep import StreamLockstep


@dataclass(frozen=True)
class TensorMeta:
    """What a consumer needs before any gather: name, dtype and full shape of one yielded tensor."""
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]


@dataclass
class StreamUnit:
    """Parameters gathered together and the ``(name, tensor)`` pairs read from them while they are gathered."""
    params: Tuple[Parameter, ...]
    produce: Callable[[], List[Tuple[str, torch.Tensor]]]
    meta: Tuple[TensorMeta, ...]

    @property
    def numel(self) -> int:
        return sum(p.ds_numel for p in self.params)


@dataclass
class StreamStats:
    """Exact counts of one stream (tests assert them): all-gathers issued, numel gathered, peak held at once."""
    allgather_calls: int = 0
    allgather_numel: int = 0
    peak_gathered_numel: int = 0
    gathered_numel: int = 0  # held by the stream now


@dataclass
class _Bucket:
    units: List[StreamUnit] = field(default_factory=list)
    gathered: List[Parameter] = field(default_factory=list)  # what this stream gathered for it
    issued: bool = False

    @property
    def pending_numel(self) -> int:
        return sum(p.ds_numel for u in self.units for p in u.params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)


def _swap_reads(params) -> List[Parameter]:
    """The NVMe partitions a gather of ``params`` would read into swap buffers ([Note: NVMe swap-in ahead])."""
    return [p for p in params if blocks_gather(p)]


def swap_buffer_count(units: Sequence[StreamUnit]) -> Optional[int]:
    """The NVMe swapper's buffer count, if any parameter of the stream lives on NVMe."""
    for unit in units:
        for param in unit.params:
            if on_nvme(param):
                return param.nvme_swapper.param_buffer_count
    return None


def cut_buckets(units: Sequence[StreamUnit], bucket_numel: int, max_reads: Optional[int] = None) -> List[_Bucket]:
    """Consecutive units, at most ``bucket_numel`` numel to gather per bucket (0: one unit per bucket) and at most
    ``max_reads`` NVMe partitions to read (the swap buffers a gather may hold at once)."""
    buckets: List[_Bucket] = []
    current, numel, reads = _Bucket(), 0, 0
    for unit in units:
        cost = sum(p.ds_numel for p in unit.params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
        unit_reads = len(_swap_reads(unit.params))
        if current.units and (bucket_numel == 0 or numel + cost > bucket_numel
                              or (max_reads is not None and reads + unit_reads > max_reads)):
            buckets.append(current)
            current, numel, reads = _Bucket(), 0, 0
        current.units.append(unit)
        numel += cost
        reads += unit_reads
    if current.units:
        buckets.append(current)
    return buckets


class WeightStream:
    """``(name, full tensor)`` for every unit, in order, on every rank ([Note: streaming weights]).

    A yielded tensor is the gathered parameter's data (or a merged copy): use or copy it before moving past its
    bucket, after which the stream releases the parameter. Iterate once; ``metadata()`` and ``groups()`` gather
    nothing.
    """

    def __init__(self, gatherer: Gatherer, residency: Residency, lock, running_pass: Callable[[], Optional[str]],
                 units: Sequence[StreamUnit], bucket_numel: int):
        """``lock``: the coordinator's, held around each gather and release; ``running_pass``: the kind of the
        pass running now, None between passes."""
        self.gatherer = gatherer
        self.residency = residency
        self.lock = lock
        self.running_pass = running_pass
        self.units = list(units)
        self.bucket_numel = bucket_numel
        self.largest_unit = max((u.numel for u in self.units), default=0)
        self.swap_buffers = swap_buffer_count(self.units)  # None: nothing on NVMe
        self.stats = StreamStats()
        self._buckets: Optional[List[_Bucket]] = None
        self._generator: Optional[Iterator] = None
        first = next((p for u in self.units for p in u.params), None)
        # [Note: a stream stops together]: over the ranks that gather together.
        self.lockstep = StreamLockstep(getattr(first, "ds_process_group", None))
        self.stop_error: Optional[BaseException] = None

    # ---------------------------------------------------------------- what a consumer reads first

    def metadata(self) -> List[TensorMeta]:
        return [meta for unit in self.units for meta in unit.meta]

    def vllm_update_info(self) -> dict:
        """``metadata()`` in the form vLLM's weight-update request takes (``names``, ``dtype_names`` such as
        "bfloat16", ``shapes``), gathering nothing: what a receiver needs before the first bucket."""
        metadata = self.metadata()
        return {"names": [m.name for m in metadata],
                "dtype_names": [str(m.dtype).removeprefix("torch.") for m in metadata],
                "shapes": [list(m.shape) for m in metadata]}

    def groups(self) -> List[List[str]]:
        """The names of each bucket, in order: what ``iter_groups()`` yields together."""
        return [[m.name for u in bucket.units for m in u.meta]
                for bucket in cut_buckets(self.units, self.bucket_numel, self.swap_buffers)]

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        try:
            for _, pairs in self._run():
                yield from pairs
        finally:  # a loop left early drops this generator: release at once, not when the stream is collected
            self.close()

    def iter_groups(self) -> Iterator[Tuple[List[str], List[torch.Tensor]]]:
        """One ``(names, tensors)`` per bucket: the consumer handles a whole bucket while the next is in flight."""
        try:
            for _, pairs in self._run():
                yield [name for name, _ in pairs], [tensor for _, tensor in pairs]
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
        return False

    def note_error(self, error: BaseException) -> None:
        """Why this rank is about to leave the loop: the other ranks' error names it ([Note: a stream stops
        together])."""
        self.stop_error = error

    def close(self) -> None:
        """Stop early: complete what is in flight and release everything the stream gathered."""
        if self._generator is not None:
            self._generator.close()
            self._generator = None

    def _run(self):
        if self._buckets is not None:
            raise RuntimeError("a WeightStream is iterated once; call iter_gathered_parameters() again for another "
                               "pass over the weights")
        running = self.running_pass()
        if running is not None:
            raise RuntimeError(f"iter_gathered_parameters: a {running} pass is running; "
                               f"stream the weights between passes (after engine.step(), or outside the model's "
                               f"forward)")
        self._buckets = cut_buckets(self.units, self.bucket_numel, self.swap_buffers)
        self._generator = self._buckets_in_order()
        return self._generator

    def _buckets_in_order(self):
        buckets = self._buckets
        try:
            for index, bucket in enumerate(buckets):
                self._issue(bucket)
                if index + 1 < len(buckets):
                    ahead = buckets[index + 1]
                    held = sum(p.ds_numel for p in bucket.gathered)
                    if (held + ahead.pending_numel <= 2 * self.bucket_numel + self.largest_unit
                            and self._swap_buffers_free_for(ahead)):
                        self._issue(ahead)
                last = bucket.units[-1].meta[-1].name if bucket.units[-1].meta else ""
                try:
                    self._wait(bucket, check=True)
                    pairs = [pair for unit in bucket.units for pair in unit.produce()]
                    yield bucket, pairs
                except GeneratorExit:
                    self.lockstep.stopped(last, self.stop_error)  # [Note: a stream stops together]
                    raise
                except Exception as error:
                    self.lockstep.stopped(last, error)
                    raise
                self.lockstep.went_on(last)
                self._release(bucket, buckets[index + 1:])
        finally:
            for bucket in buckets:
                if bucket.issued:
                    self._wait(bucket, check=False)
                    self._release(bucket, ())

    # ---------------------------------------------------------------- gathering

    def _swap_buffers_free_for(self, bucket: _Bucket) -> bool:
        """An NVMe bucket is issued ahead only if the swapper has a free buffer for each partition it reads (its
        gather reads them synchronously and asserts one); otherwise after the current bucket gives its back."""
        reads = _swap_reads(p for u in bucket.units for p in u.params)
        return not reads or len(reads) <= reads[0].nvme_swapper.available_swap_in_buffers()

    def _issue(self, bucket: _Bucket) -> None:
        if bucket.issued:
            return
        bucket.issued = True
        params = list(dict.fromkeys(p for u in bucket.units for p in u.params))  # a shared parameter once
        with self.lock:
            for group in self.gatherer.submit(params):
                numel = sum(p.ds_numel for p in group)
                self.stats.allgather_calls += 1
                self.stats.allgather_numel += numel
                self.stats.gathered_numel += numel
                for param in group:
                    self.residency.hold(param)
                bucket.gathered.extend(group)
        self.stats.peak_gathered_numel = max(self.stats.peak_gathered_numel, self.stats.gathered_numel)

    def _wait(self, bucket: _Bucket, check: bool) -> None:
        params = [p for u in bucket.units for p in u.params]
        with self.lock:
            self.gatherer.wait(params)
        for param in params if check else ():
            if param.ds_status != ZeroParamStatus.AVAILABLE:
                raise RuntimeError(f"deepspeed-zero3: parameter ds_id={param.ds_id} shape={tuple(param.ds_shape)} is "
                                   f"{param.ds_status.name} after the weight stream's gather; expected AVAILABLE")

    def _release(self, bucket: _Bucket, later: Sequence[_Bucket]) -> None:
        """Release what ``bucket`` gathered, except what an issued bucket of ``later`` uses too (a parameter two
        units share): that bucket found it gathered and did not gather it, so it takes it over."""
        with self.lock:
            for param in bucket.gathered:
                taker = next((b for b in later if b.issued and any(p is param for u in b.units for p in u.params)),
                             None)
                if taker is not None:
                    taker.gathered.append(param)
                    continue
                self.gatherer.inflight.pop(param, None)
                self.stats.gathered_numel -= param.ds_numel
                self.residency.unhold(param)
                self.residency.release(param)  # [Note: residency]
        bucket.gathered = []
        bucket.issued = False
