"""Which modules ``stage3_module_granularity_threshold`` makes z3 leaves: our selection against upstream's own code.

Upstream's ``DeepSpeedZeRoOffload`` methods are loaded from deepspeed's installed file (the import hook serves
ours under the module name) and run on an identical copy of each model.
"""

import copy
import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import deepspeed
from deepspeed.utils import z3_leaf_module

from deepspeed_zero3.runtime.zero import leaf_granularity
from deepspeed_zero3.runtime.zero.leaf_granularity import (NOT_A_LEAF, apply_granularity_threshold,
                                                           check_granularity_threshold, select_leaves)
from deepspeed_zero3.testing.models import TinyGPT, model_b


def upstream_offload_class():
    path = Path(deepspeed.__file__).parent / "runtime" / "zero" / "parameter_offload.py"
    spec = importlib.util.spec_from_file_location("upstream_parameter_offload_for_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.print_rank_0 = lambda *args, **kwargs: None  # it asks deepspeed.comm for the rank; one process here
    return module.DeepSpeedZeRoOffload


UPSTREAM = upstream_offload_class()


def with_ds_numel(model):
    for param in model.parameters():
        param.ds_numel = param.numel()
    return model


def upstream_selection(model, threshold):
    """Upstream's _set_z3_leaf_modules_by_threshold on ``model`` (it sets the leaves); returns (leaves, min, class)."""
    offload = object.__new__(UPSTREAM)
    offload.min_granularity_value = sys.maxsize
    offload.min_granularity_layer = None
    offload.granularity_info = set()
    offload.z3_leaf_layers = []
    offload._set_z3_leaf_modules_by_threshold(model, threshold)
    return offload


def names_of(model, modules):
    names = {m: n for n, m in model.named_modules()}
    return [names[m] for m in modules]


class Sequential(nn.Module):
    """Not torch's, but named like a container: upstream decides by class name, so never a leaf."""

    def __init__(self, *mods):
        super().__init__()
        self.mods = nn.ModuleList(mods)

    def forward(self, x):
        for m in self.mods:
            x = m(x)
        return x


class Tree(nn.Module):
    """A random module tree: own parameters, children, parameter-less children."""

    def __init__(self, rng, depth):
        super().__init__()
        if rng.random() < 0.5:
            self.own = nn.Parameter(torch.zeros(rng.randint(1, 300)))
        for index in range(rng.randint(0, 3) if depth > 0 else 0):
            kind = rng.random()
            if kind < 0.2:
                child = nn.GELU()
            elif kind < 0.4:
                child = nn.Linear(rng.randint(1, 40), rng.randint(1, 40))
            elif kind < 0.5:
                child = nn.ModuleList([Tree(rng, depth - 1), nn.Linear(3, 3)])
            else:
                child = Tree(rng, depth - 1)
            self.add_module(f"c{index}", child)


def shared_weight_model():
    """A parameter shared by two children: counted in each child's subtree, as upstream counts it."""
    model = nn.Module()
    model.a = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model.b = nn.Module()
    model.b.x = nn.Linear(8, 8)
    model.b.y = nn.Linear(8, 8)
    model.b.y.weight = model.a[0].weight
    return model


MODELS = {
    "model_b": lambda: model_b(),
    "tiny_gpt": lambda: TinyGPT(vocab=512, dim=32, heads=2, layers=2),
    "tiny_gpt_tied": lambda: _tied(TinyGPT(vocab=64, dim=32, heads=2, layers=3)),
    "named_sequential": lambda: _named_sequential(),
    "shared_weight": shared_weight_model,
    **{f"random_{seed}": (lambda seed=seed: Tree(random.Random(seed), 4)) for seed in range(12)},
}


def _tied(model):
    model.lm_head.weight = model.tok.weight
    return model


def _named_sequential():
    outer = nn.Module()
    outer.block = Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    outer.head = nn.Linear(4, 2)
    return outer


def thresholds_for(model):
    values = sorted({v for v in select_leaves(with_ds_numel(model), 0).granularity.values() if v != NOT_A_LEAF})
    around = {0, 1, 10**12}
    for value in values:
        around.update({value - 1, value, value + 1})
    return sorted(t for t in around if t > 0)


@pytest.mark.parametrize("name", list(MODELS))
def test_same_leaves_and_smallest_as_upstream_at_every_boundary(name):
    torch.manual_seed(0)
    reference = with_ds_numel(MODELS[name]())
    for threshold in thresholds_for(reference):
        ours_model, theirs_model = copy.deepcopy(reference), copy.deepcopy(reference)
        with_ds_numel(ours_model), with_ds_numel(theirs_model)
        ours = apply_granularity_threshold(ours_model, threshold)
        theirs = upstream_selection(theirs_model, threshold)
        assert names_of(ours_model, ours.leaves) == names_of(theirs_model, theirs.z3_leaf_layers), threshold
        assert (ours.smallest_value, ours.smallest_class) == (theirs.min_granularity_value,
                                                              theirs.min_granularity_layer), threshold
        for (n1, m1), (n2, m2) in zip(ours_model.named_modules(), theirs_model.named_modules()):
            assert n1 == n2
            assert z3_leaf_module(m1) == z3_leaf_module(m2), (threshold, n1)
            assert getattr(m1, "ds_model_granularity", None) == getattr(m2, "ds_model_granularity", None), n1


def test_values_of_the_parity_models():
    gpt = with_ds_numel(TinyGPT(vocab=512, dim=32, heads=2, layers=2))
    values = {n: v for n, v in ((n, select_leaves(gpt, 0).granularity[m]) for n, m in gpt.named_modules())
              if v != NOT_A_LEAF}
    assert values == {"blocks.0.attn": 1408, "blocks.0": 1588, "blocks.1.attn": 1408, "blocks.1": 1588, "": 2870}
    assert select_leaves(gpt, 1407).leaves == []
    assert names_of(gpt, select_leaves(gpt, 1408).leaves) == ["blocks.0.attn", "blocks.1.attn"]
    assert names_of(gpt, select_leaves(gpt, 2869).leaves) == ["blocks.0", "blocks.1"]
    assert names_of(gpt, select_leaves(gpt, 2870).leaves) == [""]  # the root itself
    b = with_ds_numel(model_b())
    selection = select_leaves(b, 9516)
    assert selection.leaves == [] and (selection.smallest_value, selection.smallest_class) == (9517, "ResidualMLP")


def test_warning_names_the_threshold_and_the_smallest_value(monkeypatch):
    messages = []
    monkeypatch.setattr(leaf_granularity.logger, "warning", messages.append)
    model = with_ds_numel(TinyGPT(vocab=512, dim=32, heads=2, layers=2))
    assert apply_granularity_threshold(model, 1407).leaves == []
    assert len(messages) == 1
    assert "stage3_module_granularity_threshold=1407 has no effect" in messages[0]
    assert "smallest module granularity in this model is 1408 (CausalSelfAttention)" in messages[0]
    assert ">= 1408" in messages[0]
    assert not any(z3_leaf_module(m) for m in model.modules())


def test_warning_when_no_module_can_be_a_leaf(monkeypatch):
    messages = []
    monkeypatch.setattr(leaf_granularity.logger, "warning", messages.append)
    model = with_ds_numel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    assert apply_granularity_threshold(model, 10**9).leaves == []
    assert "no module of this model can become a z3 leaf" in messages[0]


def test_subtree_over_the_max_leaf_size_is_never_a_leaf():
    model = nn.Module()
    model.block = nn.Module()
    model.block.a = nn.Linear(2, 2)
    model.block.b = nn.Linear(2, 2)
    model.other = nn.Linear(2, 2)
    with_ds_numel(model)
    model.block.a.weight.ds_numel = int(leaf_granularity.Z3_MAX_LEAF_SIZE)  # the subtree passes 1e9
    selection = select_leaves(model, 10**12)
    assert selection.granularity[model.block] == NOT_A_LEAF and selection.leaves == []


@pytest.mark.parametrize("bad", [-1, 1.5, "100", True])
def test_bad_threshold_is_named(bad):
    with pytest.raises(ValueError, match=r"zero_optimization.stage3_module_granularity_threshold=.* is not allowed"):
        check_granularity_threshold(bad)
