"""[Note: a stream stops together]: a rank whose consumer raises or leaves the loop alone stops every rank after
that bucket, with an error naming it; nobody issues an all-gather another rank never joins."""

import pytest
import torch

import deepspeed_zero3
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed_zero3 import safetensors_file
from deepspeed_zero3.testing.engines import batch, train_step, training_engine, zero3_config
from deepspeed_zero3.testing.models import model_b

BUCKET = 50_000


def engine_over_model_b():
    torch.manual_seed(0)
    model = model_b()
    return model, training_engine(model, zero3_config(bucket=BUCKET, reuse=0))


def all_released(model):
    return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters() if not p.ds_persist)


def test_a_full_stream_agrees_once_per_bucket():
    model, engine = engine_over_model_b()
    stream = deepspeed_zero3.iter_gathered_parameters(engine)
    buckets = len(stream.groups())
    assert sum(1 for _ in stream) == len(list(model.parameters()))
    assert (buckets, stream.lockstep.checks) == (5, 5)
    engine.destroy()


@pytest.mark.parametrize("noted", [False, True], ids=["plain_raise", "note_error"])
def test_a_consumer_raising_on_rank_0_stops_every_rank_within_one_bucket(noted):
    rank = torch.distributed.get_rank()
    model, engine = engine_over_model_b()
    stream = deepspeed_zero3.iter_gathered_parameters(engine)
    groups = stream.groups()
    handled = []
    with pytest.raises(OSError if rank == 0 else RuntimeError) as info:
        for index, (names, tensors) in enumerate(stream.iter_groups()):
            if rank == 0 and index == 1:
                error = OSError(28, "No space left on device")
                if noted:
                    stream.note_error(error)
                raise error
            handled.append(names)
    last = groups[1][-1]
    if rank == 0:
        assert handled == groups[:1]
    else:
        assert handled == groups[:2]  # this rank handled bucket 1 and stopped before bucket 2's all-gather
        reason = "OSError: [Errno 28] No space left on device" if noted else "its loop left early"
        assert str(info.value).startswith(f"deepspeed-zero3: the weight stream stopped on rank 0 after {last!r} "
                                          f"({reason}); every rank stops with it here (this rank had handled up to "
                                          f"{last!r})")
    assert all_released(model)
    train_step(engine, batch(0, rank))  # the ranks are still in step
    engine.destroy()


def test_a_break_on_every_rank_is_a_quiet_end_and_on_one_rank_an_error():
    rank = torch.distributed.get_rank()
    model, engine = engine_over_model_b()
    for _ in deepspeed_zero3.iter_gathered_parameters(engine).iter_groups():
        break
    assert all_released(model)
    stream = deepspeed_zero3.iter_gathered_parameters(engine)
    first = stream.groups()[0][-1]
    if rank == 1:
        for _ in stream.iter_groups():
            break
    else:
        with pytest.raises(RuntimeError, match=rf"stopped on rank 1 after '{first}' \(its loop left early\)"):
            for _ in stream.iter_groups():
                pass
    assert all_released(model)
    engine.destroy()


def test_a_failed_write_on_rank_0_ends_save_16bit_model_on_every_rank(tmp_path, monkeypatch):
    rank = torch.distributed.get_rank()
    model, engine = engine_over_model_b()
    box = [str(tmp_path / "saved")]
    torch.distributed.broadcast_object_list(box, src=0)
    written = []

    def full_disk(self, name, tensor):
        if len(written) == 3:
            raise OSError(28, "No space left on device")
        written.append(name)

    monkeypatch.setattr(safetensors_file.SafetensorsWriter, "append", full_disk)
    with pytest.raises(OSError if rank == 0 else RuntimeError) as info:
        deepspeed_zero3.save_16bit_model(engine, box[0])
    if rank == 1:
        assert "stopped on rank 0 after" in str(info.value)
        assert "(OSError: [Errno 28] No space left on device)" in str(info.value)
    assert all_released(model)
    train_step(engine, batch(0, rank))
    engine.destroy()
