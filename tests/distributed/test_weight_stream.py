"""``deepspeed_zero3.iter_gathered_parameters`` ([Note: streaming weights]): bucketed, one bucket in flight ahead.

Model B (199,876 parameters), bucket 20,000. In named order the parameters are inp (1,024 + 64), then per block
up (16,384 + 256) and down (16,384 + 64), then head (256 + 4). Cut at 20,000 numel to gather, the buckets are
inp + block 0's up (17,728), then every Linear of the blocks alone (16,448 or 16,640), the last down with the head
(16,708): 12 buckets, one coalesced all-gather each; the largest two consecutive ones, 34,176, are the peak.
"""

import sys
from pathlib import Path

import pytest
import torch

import deepspeed
import deepspeed_zero3
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed_zero3.testing.engines import batch, gathered_copies, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import MODEL_B_NUMEL, model_b

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from scenarios_nvme import nvme_config, nvme_model, nvme_unavailable, swap_dir_for_all_ranks  # noqa: E402

MODEL_B = MODEL_B_NUMEL
BUCKET = 20_000
BUCKETS = 12
PEAK = 17_728 + 16_448


def engine_over(model, **config):
    return training_engine(model, zero3_config(bucket=BUCKET, reuse=0, **config))


def nothing_gathered(model):
    return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())


def test_values_order_and_exact_counts():
    torch.manual_seed(0)
    model = model_b()
    engine = engine_over(model)
    train_step(engine, batch(0, torch.distributed.get_rank()))
    expected = gathered_copies(model.parameters())
    stream = deepspeed_zero3.iter_gathered_parameters(engine)
    assert [m.name for m in stream.metadata()] == [name for name, _ in model.named_parameters()]
    assert [m.shape for m in stream.metadata()] == [tuple(p.ds_shape) for p in model.parameters()]
    assert len(stream.groups()) == BUCKETS and stream.stats.allgather_calls == 0  # metadata gathers nothing
    got = [(name, tensor.clone()) for name, tensor in stream]
    assert [name for name, _ in got] == [name for name, _ in model.named_parameters()]
    assert all(torch.equal(t, e) for (_, t), e in zip(got, expected, strict=True))
    assert (stream.stats.allgather_calls, stream.stats.allgather_numel, stream.stats.peak_gathered_numel) == (
        BUCKETS, MODEL_B, PEAK)
    assert nothing_gathered(model) and stream.stats.gathered_numel == 0
    engine.destroy()


@pytest.mark.world_size(4)
def test_values_at_world_size_4():
    torch.manual_seed(0)
    model = model_b()
    engine = engine_over(model)
    train_step(engine, batch(0, torch.distributed.get_rank()))
    expected = gathered_copies(model.parameters())
    got = [tensor.clone() for _, tensor in deepspeed_zero3.iter_gathered_parameters(engine, bucket_numel=50_000)]
    assert all(torch.equal(t, e) for t, e in zip(got, expected, strict=True))
    assert nothing_gathered(model)
    engine.destroy()


def test_groups_bucket_zero_and_selected_names():
    torch.manual_seed(0)
    model = model_b()
    engine = engine_over(model)
    by_group = list(deepspeed_zero3.iter_gathered_parameters(engine).iter_groups())
    assert [len(names) for names, _ in by_group] == [4] + [2] * 10 + [4]
    one_at_a_time = deepspeed_zero3.iter_gathered_parameters(model, bucket_numel=0)
    assert sum(1 for _ in one_at_a_time) == len(list(model.parameters()))
    assert one_at_a_time.stats.allgather_calls == len(list(model.parameters()))
    chosen = ["head.weight", "inp.bias"]
    selected = deepspeed_zero3.iter_gathered_parameters(engine, names=chosen)
    assert [name for name, _ in selected] == ["inp.bias", "head.weight"]  # the model's order
    assert selected.stats.allgather_numel == 64 + 256
    assert nothing_gathered(model)
    engine.destroy()


@pytest.mark.parametrize("leave", ["break", "exception", "close"])
def test_leaving_early_releases_everything_and_training_goes_on_bitwise(leave):
    rank = torch.distributed.get_rank()

    def run(stream_once: bool):
        torch.manual_seed(0)
        model = model_b()
        engine = engine_over(model)
        losses = [train_step(engine, batch(0, rank))]
        if stream_once:
            stream = deepspeed_zero3.iter_gathered_parameters(engine)
            if leave == "break":
                for index, _ in enumerate(stream):
                    if index == 5:
                        break
            elif leave == "exception":
                with pytest.raises(ValueError, match="consumer failed"):
                    for index, _ in enumerate(stream):
                        if index == 5:
                            raise ValueError("consumer failed")
            else:
                iterator = iter(stream)
                for _ in range(6):
                    next(iterator)
                stream.close()
            assert nothing_gathered(model) and stream.stats.gathered_numel == 0
            assert stream.stats.allgather_calls == 3  # buckets 0 and 1 (parameters 0-5) and bucket 2 in flight
        losses += [train_step(engine, batch(step, rank)) for step in (1, 2)]
        params = gathered_copies(model.parameters())
        engine.destroy()
        return losses, params

    losses, params = run(stream_once=True)
    expected_losses, expected_params = run(stream_once=False)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(params, expected_params, strict=True))


def test_parameters_already_gathered_are_yielded_without_a_gather():
    torch.manual_seed(0)
    model = model_b()
    engine = engine_over(model)
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        # Before 0.19.8 the context waits only for the last of its gloo all-gathers; gloo's barrier waits for every
        # earlier collective of the group, so all the values have arrived before they are read.
        torch.distributed.barrier()
        stream = deepspeed_zero3.iter_gathered_parameters(engine)
        got = [tensor.clone() for _, tensor in stream]
        assert stream.stats.allgather_calls == 0
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in params)  # still the context's
        assert all(torch.equal(t, p.detach()) for t, p in zip(got, params, strict=True))
    assert nothing_gathered(model)
    engine.destroy()


def test_cpu_parameter_offload():
    torch.manual_seed(0)
    model = model_b()
    engine = engine_over(model, offload_param={"device": "cpu", "pin_memory": False})
    train_step(engine, batch(0, torch.distributed.get_rank()))
    expected = gathered_copies(model.parameters())
    got = [tensor.clone() for _, tensor in deepspeed_zero3.iter_gathered_parameters(engine)]
    assert all(torch.equal(t, e) for t, e in zip(got, expected, strict=True))
    assert nothing_gathered(model)
    engine.destroy()


def test_whole_float_buckets_and_modules_attached_after_initialize():
    """``bucket_numel=5e4`` is taken as the config takes ``5e7``; a plain parameter (a head attached after
    initialize) is yielded as it is, gathering nothing."""
    torch.manual_seed(0)
    model = model_b()
    engine = engine_over(model)
    model.extra = torch.nn.Linear(3, 2)
    stream = deepspeed_zero3.iter_gathered_parameters(engine, bucket_numel=5e4)
    got = {name: tensor.clone() for name, tensor in stream}
    assert torch.equal(got["extra.weight"], model.extra.weight.detach())
    assert len(got) == len(list(model.named_parameters()))
    # Before the first forward nothing is gathered, persistent parameters included: all of Model B, not the head.
    assert (stream.stats.allgather_calls, stream.stats.allgather_numel) == (5, 199_876)
    assert [m.shape for m in deepspeed_zero3.iter_gathered_parameters(engine).metadata()[-2:]] == [(2, 3), (2, )]
    info = deepspeed_zero3.iter_gathered_parameters(engine, names=["head.weight", "extra.bias"]).vllm_update_info()
    assert info == {"names": ["head.weight", "extra.bias"], "dtype_names": ["float32", "float32"],
                    "shapes": [list(model.head.weight.ds_shape), [2]]}
    engine.destroy()


def test_bad_input_is_named():
    torch.manual_seed(0)
    model = model_b()
    engine = engine_over(model)
    with pytest.raises(ValueError, match=r"1 name\(s\) not in the model: 'head.wieght' \(did you mean 'head.weight'\?\)"):
        deepspeed_zero3.iter_gathered_parameters(engine, names=["head.wieght"])
    with pytest.raises(TypeError, match="names='head.weight' is one string"):
        deepspeed_zero3.iter_gathered_parameters(engine, names="head.weight")
    with pytest.raises(ValueError, match="bucket_numel=-1 is not allowed"):
        deepspeed_zero3.iter_gathered_parameters(engine, bucket_numel=-1)
    with pytest.raises(ValueError, match="parameter 'weight' of Linear is not partitioned \\(no ds_id\\), nor is any other"):
        deepspeed_zero3.iter_gathered_parameters(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="got str"):
        deepspeed_zero3.iter_gathered_parameters("model")
    with pytest.raises(ValueError, match="expects a peft LoRA model"):
        deepspeed_zero3.iter_gathered_parameters(engine, merge_adapters=True)
    stream = deepspeed_zero3.iter_gathered_parameters(engine)
    list(stream)
    with pytest.raises(RuntimeError, match="iterated once"):
        list(stream)
    engine.destroy()


def test_nvme_parameter_offload_within_the_swap_buffers():
    """Four 1 MiB partitions per rank on NVMe and two swap buffers: a bucket reads at most two of them, and is
    issued ahead only while buffers are free; values equal GatheredParameters, and every buffer is free after."""
    import shutil

    if nvme_unavailable():
        pytest.skip(nvme_unavailable())
    rank = torch.distributed.get_rank()
    swap_dir = swap_dir_for_all_ranks()
    try:
        torch.manual_seed(21)
        model = nvme_model()
        engine = training_engine(model, nvme_config(swap_dir, bucket=5_000_000, buffer_count=2))
        swapper = next(p.nvme_swapper for p in model.parameters() if getattr(p, "nvme_swapper", None) is not None)
        train_step(engine, batch(0, rank).to(torch.bfloat16))
        expected = gathered_copies(model.parameters())
        stream = deepspeed_zero3.iter_gathered_parameters(engine)
        got = [tensor.clone() for _, tensor in stream]
        assert all(torch.equal(t, e) for t, e in zip(got, expected, strict=True))
        # 4,219,908 numel fit one 5M bucket, but a bucket reads at most two NVMe partitions: two buckets, the
        # second issued once the first gave its swap buffers back (issued ahead, its gather would assert).
        assert (stream.stats.allgather_calls, stream.stats.allgather_numel) == (2, 4_219_908)
        assert swapper.available_swap_in_buffers() == 2 and nothing_gathered(model)
        train_step(engine, batch(1, rank).to(torch.bfloat16))
        engine.destroy()
    finally:
        torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(swap_dir, ignore_errors=True)


def test_after_eval_forwards_kept_parameters_are_yielded_and_left_kept():
    """Between eval forwards the whole model stays gathered ([Note: keeping across no-grad passes]): a stream then
    gathers nothing and leaves every parameter as it found it, and the next eval forward gathers nothing either."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = model_b()
    engine = training_engine(model, zero3_config(bucket=BUCKET, reuse=10**9))
    train_step(engine, batch(0, rank))
    with torch.no_grad():
        engine(batch(1, rank))
    stream = deepspeed_zero3.iter_gathered_parameters(engine)
    got = [tensor.clone() for _, tensor in stream]
    assert stream.stats.allgather_calls == 0
    assert all(p.ds_status == ZeroParamStatus.AVAILABLE for p in model.parameters())
    with torch.no_grad():
        engine(batch(2, rank))
    assert deepspeed_zero3.get_zero3_stats(engine)["passes"][-1]["allgather_numel"] == 0
    engine.empty_partition_cache()  # releases the carry
    assert all(torch.equal(t, e) for t, e in zip(got, gathered_copies(model.parameters()), strict=True))
    engine.destroy()


class StreamsInItsForward(torch.nn.Module):
    """A model whose forward starts a weight stream: refused, a pass is running."""

    def __init__(self):
        super().__init__()
        self.inner = model_b()

    def forward(self, x):
        list(deepspeed_zero3.iter_gathered_parameters(self.inner))
        return self.inner(x)


def test_a_stream_is_refused_inside_a_pass_and_a_forward_inside_a_stream_leaves_it_whole():
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = StreamsInItsForward()
    engine = engine_over(model)
    with pytest.raises(RuntimeError, match="iter_gathered_parameters: a forward pass is running"):
        engine(batch(0, rank))
    model.forward = lambda x: model.inner(x)  # no stream in the forward from here on
    expected = gathered_copies(model.parameters())
    got = []
    for index, (_, tensor) in enumerate(deepspeed_zero3.iter_gathered_parameters(engine)):
        got.append(tensor.clone())
        if index == 3:  # the consumer runs the model between two buckets, on every rank
            with torch.no_grad():
                engine(batch(1, rank))
    assert all(torch.equal(t, e) for t, e in zip(got, expected, strict=True))
    assert nothing_gathered(model)
    train_step(engine, batch(2, rank))
    engine.destroy()
