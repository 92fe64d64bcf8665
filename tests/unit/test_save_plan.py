"""``save.plan_shards`` splits as huggingface_hub does, file for file, oversized tensors included."""

import pytest
import torch

from deepspeed_zero3.save import Entry, plan_shards, shard_files

CASES = {
    "all fit": [10, 20, 30],
    "one oversized tensor in the middle": [100, 5_000, 200, 300, 9_000, 100],
    "oversized first and last": [9_000, 100, 100, 9_000],
    "exact fits": [1_000, 3_000, 4_000, 4_000],
    "every tensor oversized": [5_000, 6_000],
}
MAX_BYTES = 8_000


@pytest.mark.parametrize("numels", list(CASES.values()), ids=list(CASES))
def test_shards_equal_the_hubs(numels):
    hub = pytest.importorskip("huggingface_hub")
    names = [f"t{i}" for i in range(len(numels))]
    entries = [Entry(name, torch.bfloat16, (numel // 2, 2)) for name, numel in zip(names, numels)]
    state = {name: torch.zeros(numel // 2, 2, dtype=torch.bfloat16) for name, numel in zip(names, numels)}
    split = hub.split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=MAX_BYTES)
    shards = plan_shards(entries, MAX_BYTES)
    files, _ = shard_files(len(shards), safe=True)
    ours = {file: [entry.name for entry in shard] for file, shard in zip(files, shards)}
    assert ours == split.filename_to_tensors


def test_an_empty_model_has_one_empty_shard():
    assert plan_shards([], MAX_BYTES) == [[]]
