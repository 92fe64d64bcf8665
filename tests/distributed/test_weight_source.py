"""``deepspeed_zero3.weight_source`` against a stand-in consumer written to the weight-transfer protocol vLLM's trainer
engines follow: init (allocate from the metadata, before any data), start, update (possibly in chunks), finish.

Model B (199,876 parameters), bucket 20,000: 12 buckets, peak 34,176 (tests/distributed/test_weight_stream.py). The
consumer is a plain Model B on each rank with other initial weights; after two syncs, each after a training step,
its weights equal the trainer's bitwise. The metadata gathers nothing; every iteration is a fresh stream.
"""

import pytest
import torch

import deepspeed_zero3
from deepspeed_zero3.testing.collectives import parameter_gathers
from deepspeed_zero3.testing.engines import batch, gathered_copies, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import MODEL_B_NUMEL, model_b

BUCKET = 20_000
LARGEST_PARAM = 64 * 256


class StandInConsumer:
    """Receives weights in the four phases of a weight transfer, into a plain model of its own."""

    def __init__(self, model, chunk: int):
        self.model, self.chunk = model, chunk
        self.phases = []

    def init(self, metadata):
        self.phases.append("init")
        params = dict(self.model.named_parameters())
        for name, dtype, shape in metadata:  # allocation is checked before any data arrives
            assert params[name].dtype == dtype and tuple(params[name].shape) == tuple(shape), name
        self.expected = [name for name, _, _ in metadata]

    def start(self):
        self.phases.append("start")
        self.received = []

    def update(self, chunk):
        self.phases.append("update")
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in chunk:
                params[name].copy_(tensor)
                self.received.append(name)

    def finish(self):
        self.phases.append("finish")
        assert self.received == self.expected

    def sync(self, source):
        self.start()
        chunk = []
        for pair in source:
            chunk.append(pair)
            if len(chunk) == self.chunk:
                self.update(chunk)
                chunk = []
        if chunk:
            self.update(chunk)
        self.finish()


def test_a_stand_in_consumer_gets_the_trainers_weights_bitwise():
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=BUCKET, reuse=0))
    torch.manual_seed(1)
    consumer = StandInConsumer(model_b(), chunk=5)
    with parameter_gathers() as counted:
        source = deepspeed_zero3.weight_source(engine)
        metadata = source.metadata()
    assert counted["calls"] == 0
    assert [name for name, _, _ in metadata] == [name for name, _ in model.named_parameters()]
    consumer.init(metadata)
    for step in range(2):
        train_step(engine, batch(step, rank))
        consumer.sync(source)
        assert (source.stats.allgather_calls, source.stats.allgather_numel) == (12, MODEL_B_NUMEL)
        assert source.stats.peak_gathered_numel <= 2 * BUCKET + LARGEST_PARAM
        expected = gathered_copies(model.parameters())
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(consumer.model.parameters(), expected,
                                                                      strict=True))
    updates = -(-len(metadata) // 5)  # 28 tensors in chunks of 5: 6 updates per sync
    assert len(metadata) == 28 and updates == 6
    assert consumer.phases == ["init"] + (["start"] + ["update"] * updates + ["finish"]) * 2
    engine.destroy()


def test_bad_input_is_refused_when_the_source_is_made():
    torch.manual_seed(0)
    engine = training_engine(model_b(), zero3_config(bucket=BUCKET, reuse=0))
    with pytest.raises(ValueError, match=r"bucket_numel=-1 is not allowed"):
        deepspeed_zero3.weight_source(engine, bucket_numel=-1)
    with pytest.raises(ValueError, match=r"1 name\(s\) not in the model: 'head.wieght' \(did you mean 'head.weight'\?\)"):
        deepspeed_zero3.weight_source(engine, names=["head.wieght"])
    engine.destroy()
