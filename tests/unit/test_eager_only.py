"""Every hook of ours, every backward callback and the coordinator's entry points are eager_only, and the
wrapping does not import torch._dynamo ([Note: what Dynamo may trace] in eager.py)."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from deepspeed_zero3.runtime.zero.eager import eager_only
from deepspeed_zero3.runtime.zero.hooks import HookRouter
from deepspeed_zero3.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

LAZY_DISABLE_CODE = eager_only(lambda: None).__code__


def is_eager_only(function) -> bool:
    function = getattr(function, "__func__", function)
    return function.__code__ is LAZY_DISABLE_CODE and hasattr(function, "__wrapped__")


def test_every_installed_hook_is_eager_only():
    router = HookRouter(coordinator=None)
    module = nn.Linear(2, 2)
    handles = router.install_module_hooks(module).all() + router.install_root_hooks(module)
    hooks = list(module._forward_pre_hooks.values()) + list(module._forward_hooks.values())
    assert len(hooks) == len(handles) == 6
    assert [h for h in hooks if not is_eager_only(h)] == []


@pytest.mark.parametrize("callback", ["pre_backward", "input_grad_done"])
def test_backward_callbacks_are_eager_only(callback):
    # Compiled autograd traces BackwardHook.backward; the callback it calls must stay a graph break.
    assert is_eager_only(getattr(HookRouter(coordinator=None), callback))


@pytest.mark.parametrize("method", [
    "fetch_sub_module", "release_sub_module", "reset_step", "release_backward_leftovers", "release_and_reset_all",
    "_autograd_finished"
])
def test_coordinator_entry_points_are_eager_only(method):
    assert is_eager_only(getattr(PartitionedParameterCoordinator, method))


def test_eager_only_runs_the_function_and_keeps_its_name():

    def double(x):
        """Twice x."""
        return 2 * x

    wrapped = eager_only(double)
    assert wrapped(torch.ones(1)).item() == 2.0
    assert wrapped.__name__ == "double" and wrapped.__doc__ == "Twice x."


def test_importing_the_runtime_does_not_import_dynamo():
    """Ours adds no torch._dynamo import to what upstream's own imports of these modules bring (deepspeed
    0.19.4-0.19.7's runtime/compiler.py imports torch._dynamo itself; 0.19.8's does not)."""
    code = ("import sys\n"
            "import deepspeed.runtime.compiler, deepspeed.runtime.zero.partition_parameters\n"
            "upstream = 'torch._dynamo' in sys.modules\n"
            "import deepspeed_zero3.runtime.zero.hooks, deepspeed_zero3.runtime.zero.partitioned_param_coordinator\n"
            "import deepspeed_zero3.runtime.zero.parameter_offload\n"
            "print(upstream, 'torch._dynamo' in sys.modules)\n")
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    upstream, ours = out.stdout.strip().splitlines()[-1].split()
    if upstream == "True":
        pytest.skip("this deepspeed release imports torch._dynamo itself")
    assert ours == "False"
