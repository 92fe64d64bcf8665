"""ZenFlow's parameter side ([Note: ZenFlow layout]): transposed into compute layout after a module's fetch and
back after its release, in forward and in backward, through the real hooks and coordinator.

One process: every parameter is persistent (gathered, never partitioned), so no collective runs and what is
tested is when the transpositions happen. Parameters are stored transposed, as ZenFlow's optimizer leaves
them; results must equal bitwise those of a plain model whose weights have the same memory layout.
"""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3.runtime.zero.gather import InflightParamRegistry
from deepspeed_zero3.runtime.zero.param_registry import ParamStateRegistry
from deepspeed_zero3.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed_zero3.runtime.zero.zenflow_params import ZenFlowParamLayout, check_zenflow_params


class TwoOutputs(nn.Module):
    """Both outputs need gradients: its pre-backward hook fires twice (upstream would transpose twice)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 6)

    def forward(self, x):
        y = self.lin(x)
        return y[:, :3], y[:, 3:]


class Net(nn.Module):

    def __init__(self, checkpointed: bool):
        super().__init__()
        self.a = nn.Linear(3, 5)
        self.b = TwoOutputs()
        self.c = nn.Linear(3, 2)
        self.square = nn.Linear(2, 2)
        self.checkpointed = checkpointed
        self.seen = []  # (module, weight shape) inside each forward

    def forward(self, x):
        h = torch.tanh(self.a(x))
        p, q = self.b(h)
        h = self.c(p * q)
        if self.checkpointed:
            return checkpoint(self.square, h, use_reentrant=False)
        return self.square(h)


def zenflow_layout(model):
    """Store every non-1-D parameter transposed and give it the ZeRO attributes of a persistent parameter."""
    for ds_id, param in enumerate(model.parameters()):
        if param.dim() != 1:
            param.data = param.data.t().contiguous()
        param.ds_id = ds_id
        param.ds_shape = param.data.shape
        param.ds_numel = param.numel()
        param.ds_status = ZeroParamStatus.AVAILABLE
        param.ds_persist = True
        param.ds_active_sub_modules = set()
        param.is_external_param = False
    return model


def same_memory_layout(model):
    """The plain model with each 2-D weight a transposed view of a transposed copy: what the modules compute on
    under ZenFlow (BLAS rounds differently on a non-contiguous weight, so only this is bitwise comparable)."""
    for param in model.parameters():
        if param.dim() != 1:
            param.data = param.data.t().contiguous().t()
    return model


def coordinator_with_layout():
    coordinator = PartitionedParameterCoordinator(prefetch_bucket_sz=0, max_reuse_distance_in_numel=0,
                                                  max_available_parameters_in_numel=10**9, allgather_stream=None,
                                                  inflight_param_registry=InflightParamRegistry())
    coordinator.param_layout = ZenFlowParamLayout()
    return coordinator


def watch_layout(model):
    for name in ("a", "c", "square"):
        module = getattr(model, name)
        module.register_forward_pre_hook(
            lambda m, args, name=name: model.seen.append((name, tuple(m.weight.shape), torch.is_grad_enabled())))


def storage_layout_everywhere(model):
    return all(tuple(p.data.shape) == tuple(p.ds_shape) for p in model.parameters())


@pytest.mark.parametrize("checkpointed", [False, True])
def test_compute_layout_inside_modules_storage_layout_outside(checkpointed):
    torch.manual_seed(0)
    reference = same_memory_layout(Net(checkpointed))
    model = zenflow_layout(copy.deepcopy(reference))
    registry = ParamStateRegistry(coordinator_with_layout(), {})
    registry.adopt_tree(model)
    watch_layout(model)
    layout = registry.coordinator.param_layout

    for step in range(2):
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(step))
        expected = reference(x)
        out = model(x)
        assert torch.equal(out, expected)
        # Between passes: every parameter back in the layout ZenFlow stores.
        assert storage_layout_everywhere(model) and not layout.flipped
        expected.sum().backward()
        out.sum().backward()
        registry.coordinator.release_backward_leftovers()  # engine.backward()'s epilogue: ends the pass
        assert storage_layout_everywhere(model) and not layout.flipped

    # Forward modules saw the original layout; so did the checkpointed recompute inside backward.
    assert {(name, shape) for name, shape, _ in model.seen} == {("a", (5, 3)), ("c", (2, 3)), ("square", (2, 2))}
    recomputed = [s for s in model.seen if s[0] == "square"]
    assert len(recomputed) == (4 if checkpointed else 2)
    for (name, ref), param in zip(reference.named_parameters(), model.parameters()):
        # Gradients are taken in compute layout (ZenFlow's optimizer transposes them when it buckets them).
        assert torch.equal(param.grad, ref.grad), name
    registry.close()


def test_eval_forward_and_persistent_parameters_left_in_storage_layout():
    torch.manual_seed(1)
    reference = same_memory_layout(Net(checkpointed=False))
    model = zenflow_layout(copy.deepcopy(reference))
    registry = ParamStateRegistry(coordinator_with_layout(), {})
    registry.adopt_tree(model)
    with torch.no_grad():
        x = torch.randn(2, 3)
        assert torch.equal(model(x), reference(x))
    assert storage_layout_everywhere(model)
    registry.close()


def test_more_than_two_dimensions_is_refused_by_name():
    conv = nn.Conv2d(2, 3, 3)
    for p in conv.parameters():
        p.ds_shape = p.shape
    with pytest.raises(ValueError, match=r"supports only 1-D and 2-D parameters; 1 have more dimensions: "
                       r"weight \(3, 2, 3, 3\)"):
        check_zenflow_params(conv.named_parameters())
