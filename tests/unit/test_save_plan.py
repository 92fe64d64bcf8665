"""``save.plan_shards`` splits as huggingface_hub does, file for file, oversized tensors included.

The expected splits are huggingface_hub 2.4.0's ``split_torch_state_dict_into_shards`` on the same tensors at
8,000 bytes, written out so that the test runs without the hub (``make test-unit`` runs before the integration
dependencies are installed); where the hub is installed, it is asked as well.
"""

import pytest
import torch

from deepspeed_zero3.save import Entry, plan_shards, shard_files

MAX_BYTES = 8_000
# bf16 numels per tensor -> the hub's shards, by tensor index
CASES = {
    "all fit": ([10, 20, 30], [[0, 1, 2]]),
    "one oversized tensor in the middle": ([100, 5_000, 200, 300, 9_000, 100], [[1], [4], [0, 2, 3, 5]]),
    "oversized first and last": ([9_000, 100, 100, 9_000], [[0], [3], [1, 2]]),
    "exact fits": ([1_000, 3_000, 4_000, 4_000], [[0, 1], [2], [3]]),
    "every tensor oversized": ([5_000, 6_000], [[0], [1]]),
}


def ours(numels):
    entries = [Entry(f"t{i}", torch.bfloat16, (numel // 2, 2)) for i, numel in enumerate(numels)]
    shards = plan_shards(entries, MAX_BYTES)
    files, _ = shard_files(len(shards), safe=True)
    return {file: [entry.name for entry in shard] for file, shard in zip(files, shards)}


@pytest.mark.parametrize("numels,expected", list(CASES.values()), ids=list(CASES))
def test_shards_equal_the_hubs(numels, expected):
    files, _ = shard_files(len(expected), safe=True)
    assert ours(numels) == {file: [f"t{i}" for i in shard] for file, shard in zip(files, expected)}


@pytest.mark.parametrize("numels", [numels for numels, _ in CASES.values()], ids=list(CASES))
def test_the_installed_hub_agrees(numels):
    hub = pytest.importorskip("huggingface_hub")
    state = {f"t{i}": torch.zeros(numel // 2, 2, dtype=torch.bfloat16) for i, numel in enumerate(numels)}
    split = hub.split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                                   max_shard_size=MAX_BYTES)
    assert ours(numels) == split.filename_to_tensors


def test_an_empty_model_has_one_empty_shard():
    assert plan_shards([], MAX_BYTES) == [[]]
