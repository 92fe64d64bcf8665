"""[Note: release capabilities]: what capabilities.py detects agrees with the installed release's own files, and
its adapters handle each shape a release has."""

import ast
import inspect
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import deepspeed

from deepspeed_zero3.runtime.zero import capabilities
from deepspeed_zero3.runtime.zero import parameter_offload as ours

UPSTREAM_OFFLOAD = Path(deepspeed.__file__).parent / "runtime" / "zero" / "parameter_offload.py"


def upstream_offload_arguments():
    """The argument names of the installed release's own DeepSpeedZeRoOffload.__init__ (its file, which ours
    shadows), in order."""
    tree = ast.parse(UPSTREAM_OFFLOAD.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepSpeedZeRoOffload")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return [a.arg for a in init.args.args]


def test_detected_features_match_the_releases_that_have_them():
    """Each feature against the release that brought it (docs/maintaining.md), not against the expression that
    detects it: the context-depth mark from 0.19.4, fast leaf sharding from 0.16.3, ZenFlow's argument from 0.18.1."""
    release = tuple(int(part) for part in deepspeed.__version__.split("+")[0].split(".")[:3])
    assert (capabilities.GATHERED_CONTEXT_DEPTH_ATTR is not None) == (release >= (0, 19, 4))
    assert capabilities.FAST_LEAF_SHARDING == (release >= (0, 16, 3))
    assert capabilities.ZENFLOW == (release >= (0, 18, 1))
    assert capabilities.ZENFLOW == ("zenflow" in upstream_offload_arguments())


def test_the_served_constructor_takes_the_release_arguments_in_its_order():
    # Positional calls of the release bind as they do there (ours accepts more, by keyword, after them).
    upstream = upstream_offload_arguments()
    served = list(inspect.signature(ours.DeepSpeedZeRoOffload.__init__).parameters)
    assert served[:len(upstream)] == upstream


def test_without_argument_drops_one_argument_and_keeps_its_default():
    def f(a, zenflow=False, overlap=True):
        return a, zenflow, overlap

    g = ours.without_argument(f, "zenflow")
    assert list(inspect.signature(g).parameters) == ["a", "overlap"]
    assert g(1, False) == (1, False, False) and g(1) == (1, False, True)


@dataclass
class Bucket:
    params: List[int] = field(default_factory=list)
    elements: int = 0
    buffer: object = "kept"


@dataclass
class BucketWithClear(Bucket):
    cleared: int = 0

    def clear_params(self):
        self.cleared += 1
        self.params.clear()
        self.elements = 0


def test_clear_reduce_bucket_empties_each_releases_shape():
    per_dtype = types.SimpleNamespace(ipg_buckets={"fp32": Bucket([1, 2], 7)})
    assert capabilities.clear_reduce_bucket(per_dtype)
    assert per_dtype.ipg_buckets["fp32"] == Bucket([], 0, "kept")
    with_clear = types.SimpleNamespace(ipg_buckets={"fp32": BucketWithClear([1, 2], 7)})
    assert capabilities.clear_reduce_bucket(with_clear)  # the release's own clear_params, where it has one
    assert with_clear.ipg_buckets["fp32"] == BucketWithClear([], 0, "kept", cleared=1)
    one_list = types.SimpleNamespace(params_in_ipg_bucket=[1, 2], grads_in_ipg_bucket=["g1", "g2"])
    assert capabilities.clear_reduce_bucket(one_list)
    assert (one_list.params_in_ipg_bucket, one_list.grads_in_ipg_bucket) == ([], [])
    assert not capabilities.clear_reduce_bucket(types.SimpleNamespace())  # no ZeRO-3 optimizer


def test_leave_backward_context_in_each_releases_form():
    calls = []
    hook_state = types.SimpleNamespace(backward_active_depth=2, reset_for_new_step=lambda: calls.append("reset"))
    newer = types.SimpleNamespace(_backward_hook_state=hook_state)
    capabilities.leave_backward_context(newer)
    assert (hook_state.backward_active_depth, calls) == (0, ["reset"])
    older = types.SimpleNamespace(_backward_active_depth=3)
    capabilities.leave_backward_context(older)
    assert older._backward_active_depth == 0
    capabilities.leave_backward_context(types.SimpleNamespace())  # before either: nothing to reset
