"""``deepspeed_zero3.save_16bit_model`` against upstream's ``engine.save_16bit_model`` on the same engine, and
``consolidated_16bit_state_dict`` against upstream's ``_zero3_consolidated_16bit_state_dict`` ([Note: saving
through the stream]): the same names (a tied parameter once in the files), the same values bit for bit."""

import json
import os

import pytest
import torch
from torch import nn

import deepspeed_zero3
from deepspeed_zero3.safetensors_file import read_safetensors
from deepspeed_zero3.testing.collectives import parameter_gathers
from deepspeed_zero3.testing.engines import gathered_copies, token_batch, training_engine, zero3_config

VOCAB = 64


class TiedWithBuffers(nn.Module):
    """Embedding and head tied; BatchNorm's persistent buffers (one int64); a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        self.norm = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, tokens, targets):
        h = self.body(self.emb(tokens))
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        return nn.functional.cross_entropy(self.head(h).reshape(-1, VOCAB), targets.reshape(-1))


def trained_engine(freeze_body=False):
    torch.manual_seed(0)
    model = TiedWithBuffers()
    if freeze_body:
        model.body.requires_grad_(False)
    engine = training_engine(model, zero3_config(bucket=3_000, reuse=0,
                                                 stage3_gather_16bit_weights_on_model_save=True))
    for step in range(2):
        engine.backward(engine(*token_batch(step, torch.distributed.get_rank(), vocab=VOCAB)))
        engine.step()
    return engine


def shared_dir(tmp_path, name):
    """One directory for both ranks (rank 0's tmp_path), as a job's save_dir is."""
    box = [str(tmp_path / name)]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def read_saved(save_dir, files):
    tensors = {}
    for name in files:
        path = os.path.join(save_dir, name)
        if name.endswith(".safetensors"):
            tensors.update(read_safetensors(path))
        elif name.endswith(".bin"):
            tensors.update(torch.load(path, weights_only=True))
    return tensors


def upstream_saved(engine, save_dir, **kwargs):
    assert engine.save_16bit_model(save_dir, **kwargs) is True
    return torch.load(os.path.join(save_dir, "pytorch_model.bin"), weights_only=True) \
        if torch.distributed.get_rank() == 0 else None


@pytest.mark.parametrize("max_shard_size, safe, expected_files", [
    ("5GB", True, ["model.safetensors"]),
    # 8,000 bytes, split as huggingface_hub splits (tests/unit/test_save_plan.py): each 8,192-byte weight in a shard
    # of its own, where it comes; every other tensor, body.0.bias included, in the shard filled around them, last.
    ("8KB", True, [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)] + ["model.safetensors.index.json"]),
    ("8KB", False, [f"pytorch_model-0000{i}-of-00004.bin" for i in range(1, 5)] + ["pytorch_model.bin.index.json"]),
    (10**9, False, ["pytorch_model.bin"]),
])
def test_files_equal_upstreams_save_by_name(tmp_path, max_shard_size, safe, expected_files):
    engine = trained_engine()
    ours_dir, upstream_dir = shared_dir(tmp_path, "ours"), shared_dir(tmp_path, "upstream")
    files = deepspeed_zero3.save_16bit_model(engine, ours_dir, max_shard_size=max_shard_size,
                                             safe_serialization=safe)
    assert files == expected_files
    upstream = upstream_saved(engine, upstream_dir)
    if torch.distributed.get_rank() == 0:
        ours = read_saved(ours_dir, files)
        # Upstream's dict holds the tied weight under both names; the files once, under the first (save_pretrained).
        assert list(upstream) == ["emb.weight", "body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias",
                                  "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var",
                                  "norm.num_batches_tracked", "head.weight"]
        assert sorted(ours) == sorted(list(upstream)[:-1])
        for name, tensor in ours.items():
            assert tensor.dtype == upstream[name].dtype and torch.equal(tensor, upstream[name]), name
        assert sorted(os.listdir(ours_dir)) == sorted(files)
        if files[-1].endswith(".index.json"):
            with open(os.path.join(ours_dir, files[-1])) as handle:
                index = json.load(handle)
            assert sorted(index["weight_map"]) == sorted(ours)
            assert set(index["weight_map"].values()) == set(files[:-1])
            assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in ours.values())
    engine.destroy()


def test_exclude_frozen_and_a_rewrite_with_fewer_shards(tmp_path):
    engine = trained_engine(freeze_body=True)
    ours_dir, upstream_dir = shared_dir(tmp_path, "ours"), shared_dir(tmp_path, "upstream")
    deepspeed_zero3.save_16bit_model(engine, ours_dir, max_shard_size="8KB")
    files = deepspeed_zero3.save_16bit_model(engine, ours_dir, exclude_frozen_parameters=True)
    upstream = upstream_saved(engine, upstream_dir, exclude_frozen_parameters=True)
    if torch.distributed.get_rank() == 0:
        assert files == ["model.safetensors"] and sorted(os.listdir(ours_dir)) == files  # the old shards are gone
        ours = read_saved(ours_dir, files)
        assert list(ours) == [name for name in upstream if name != "head.weight"]
        assert "body.0.weight" not in ours
        assert all(torch.equal(ours[name], upstream[name]) for name in ours)
    engine.destroy()


def test_consolidated_state_dict_equals_upstreams():
    engine = trained_engine()
    ours = deepspeed_zero3.consolidated_16bit_state_dict(engine)
    upstream = engine._zero3_consolidated_16bit_state_dict()
    if torch.distributed.get_rank() == 0:
        assert list(ours) == list(upstream)
        assert all(torch.equal(ours[name], upstream[name]) and ours[name].dtype == upstream[name].dtype
                   for name in ours)
        assert ours["head.weight"] is ours["emb.weight"]  # tied: one tensor, as upstream's
    else:
        assert ours is None and upstream is None
    engine.destroy()


def test_bad_input_is_refused_before_any_gather(tmp_path):
    engine = trained_engine()
    with parameter_gathers() as counted:
        refuse_bad_input(engine, tmp_path)
    assert counted["calls"] == 0
    engine.destroy()


def refuse_bad_input(engine, tmp_path):
    with pytest.raises(ValueError, match=r"max_shard_size='5 parsecs' is not allowed: expected a size such as"):
        deepspeed_zero3.save_16bit_model(engine, str(tmp_path), max_shard_size="5 parsecs")
    with pytest.raises(ValueError, match=r"max_shard_size=0 is not allowed: it must be more than 0 bytes"):
        deepspeed_zero3.save_16bit_model(engine, str(tmp_path), max_shard_size=0)
    with pytest.raises(ValueError, match=r"expects a ZeRO-3 model: parameter 'weight' of Linear is not partitioned"):
        deepspeed_zero3.save_16bit_model(nn.Linear(2, 2), str(tmp_path))
    blocker = shared_dir(tmp_path, "a_file")
    if torch.distributed.get_rank() == 0:
        open(blocker, "w").close()
    # Rank 0 cannot make a directory where a file is: every rank refuses, none gathers.
    with pytest.raises(ValueError, match=rf"save_dir='{blocker}' is not allowed: rank 0 cannot write there"):
        deepspeed_zero3.save_16bit_model(engine, blocker)


def test_training_after_a_save_is_unchanged(tmp_path):
    """Two more steps after a sharded save give the losses and parameters of the same two steps without it, bit for
    bit, and the gather counts of those steps are the same: the save leaves nothing gathered and nothing moved."""
    save_dir = shared_dir(tmp_path, "saved")

    def run(save: bool):
        engine = trained_engine()
        if save:
            deepspeed_zero3.save_16bit_model(engine, save_dir, max_shard_size="8KB")
        deepspeed_zero3.reset_zero3_stats(engine)
        losses = []
        for step in range(2, 4):
            loss = engine(*token_batch(step, torch.distributed.get_rank(), vocab=VOCAB))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        counts = [(p["kind"], p["allgather_calls"], p["allgather_numel"])
                  for p in deepspeed_zero3.get_zero3_stats(engine)["passes"]]
        params = gathered_copies(engine.module.parameters())
        engine.destroy()
        return losses, counts, params

    saved_losses, saved_counts, saved_params = run(save=True)
    losses, counts, params = run(save=False)
    assert saved_losses == losses and saved_counts == counts
    assert all(torch.equal(a, b) for a, b in zip(saved_params, params, strict=True))
