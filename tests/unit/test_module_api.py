"""Our two modules have every module-level name upstream's have, of the same kind.

The names are read from the installed upstream files when the test runs (each loaded by path under a
private name, next to ours in this process), so a new upstream version is checked against its own list.
See [Note: upstream's module names] in runtime/zero/upstream_names.py.
"""

import ast
import importlib
import importlib.util
import inspect
import os
import sys
import types

import pytest
import torch

import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

from deepspeed_zero3._compat import OVERLAID_MODULES
from zero_fakes import zmodule, zparam

UPSTREAM_DIR = os.path.join(os.path.dirname(deepspeed.__file__), "runtime", "zero")
MODULES = sorted(OVERLAID_MODULES)


def short(name):
    return name.rsplit(".", 1)[-1]


def kind(value):
    if isinstance(value, types.ModuleType):
        return "module"
    if isinstance(value, type):
        return "class"
    if callable(value):
        return "function"
    return f"value ({type(value).__name__})"


def public(names):
    return {n for n in names if not (n.startswith("__") and n.endswith("__"))}


def defined_names(tree):
    """Names a module's own top-level statements bind (not its imports), through if/try/with blocks."""
    names = set()
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                statements.extend(getattr(node, field, []))
        elif isinstance(node, ast.ExceptHandler):
            statements.extend(node.body)
    return names


def imported_from_overlaid(tree):
    """{name: overlaid module it is imported from}: upstream's parameter_offload imports from the coordinator."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in OVERLAID_MODULES:
            for alias in node.names:
                found[alias.asname or alias.name] = node.module
    return found


class Upstream:
    """One upstream module, executed from its file under a private name, with its source's AST."""

    def __init__(self, name):
        self.name = name
        self.path = os.path.join(UPSTREAM_DIR, short(name) + ".py")
        with open(self.path) as source:
            self.tree = ast.parse(source.read(), self.path)
        private = f"_upstream_{short(name)}"
        spec = importlib.util.spec_from_file_location(private, self.path)
        self.module = importlib.util.module_from_spec(spec)
        sys.modules[private] = self.module  # dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(self.module)
        except ImportError as exc:
            pytest.fail(f"upstream's {self.path} does not import next to ours: {exc}. One of its imports from "
                        f"{sorted(OVERLAID_MODULES)} names something our module lacks.")
        finally:
            sys.modules.pop(private, None)
        self.names = public(vars(self.module))
        self.defined = defined_names(self.tree) & self.names
        self.from_overlaid = imported_from_overlaid(self.tree)


@pytest.fixture(scope="module")
def upstream():
    return {name: Upstream(name) for name in MODULES}


def ours_of(name):
    return importlib.import_module(OVERLAID_MODULES[name])


def table(rows, header):
    width = max([len(header[0])] + [len(r[0]) for r in rows])
    lines = [f"  {header[0].ljust(width)}  {header[1]}"]
    lines += [f"  {r[0].ljust(width)}  {r[1]}" for r in rows]
    return "\n".join(lines)


@pytest.mark.parametrize("name", MODULES, ids=short)
def test_every_upstream_name_exists_with_the_same_kind(upstream, name):
    up, ours = upstream[name], ours_of(name)
    assert len(up.names) > 50, f"only {len(up.names)} names read from {up.path}; is that upstream's file?"
    rows = []
    for attr in sorted(up.names):
        expected = kind(getattr(up.module, attr))
        if not hasattr(ours, attr):
            rows.append((attr, f"missing (upstream: {expected})"))
        elif kind(getattr(ours, attr)) != expected:
            rows.append((attr, f"upstream: {expected}, ours: {kind(getattr(ours, attr))}"))
    assert not rows, (f"{ours.__file__} differs from upstream's {up.path} in {len(rows)} of {len(up.names)} "
                      f"module-level names:\n" + table(rows, ("name", "difference")))


@pytest.mark.parametrize("name", MODULES, ids=short)
def test_names_upstream_imports_are_the_same_objects(upstream, name):
    """A patch of e.g. ``parameter_offload.logger`` or a check ``x is ZeroParamStatus.AVAILABLE`` then means
    what it means upstream. Names upstream imports from the other module we replace are ours from there."""
    up, ours = upstream[name], ours_of(name)
    rows = []
    for attr in sorted(up.names - up.defined):
        if attr in up.from_overlaid:
            expected = getattr(ours_of(up.from_overlaid[attr]), attr)
            source = f"our {short(up.from_overlaid[attr])}.{attr}"
        else:
            expected = getattr(up.module, attr)
            source = f"upstream's object ({kind(expected)})"
        if getattr(ours, attr, None) is not expected:
            rows.append((attr, f"is not {source}"))
    assert not rows, f"{len(rows)} re-exported names of {short(name)} differ:\n" + table(rows, ("name", "problem"))


@pytest.mark.parametrize("name", MODULES, ids=short)
def test_star_import_offers_every_upstream_name(upstream, name):
    up, ours = upstream[name], ours_of(name)

    def star(module):
        names = getattr(module, "__all__", None)
        return set(names) if names is not None else {n for n in vars(module) if not n.startswith("_")}

    missing = sorted(star(up.module) - star(ours))
    assert not missing, f"`from {name} import *` gives upstream's {missing} but not ours"


def accepts_upstream_call(up_sig, our_sig):
    """Whether every call upstream's signature accepts binds to ours: same positional names in order, ours
    may add parameters only with defaults (or *args/**kwargs)."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    up_pos = [p for p in up_sig.parameters.values() if p.kind in positional]
    our_pos = [p for p in our_sig.parameters.values() if p.kind in positional]
    our_kinds = {p.kind for p in our_sig.parameters.values()}
    if [p.name for p in our_pos[:len(up_pos)]] != [p.name for p in up_pos]:
        if not (len(our_pos) < len(up_pos) and inspect.Parameter.VAR_POSITIONAL in our_kinds):
            return False
    if any(p.default is inspect.Parameter.empty for p in our_pos[len(up_pos):]):
        return False
    for param in up_sig.parameters.values():
        if param.kind is inspect.Parameter.KEYWORD_ONLY and param.name not in our_sig.parameters:
            if inspect.Parameter.VAR_KEYWORD not in our_kinds:
                return False
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if param.kind not in our_kinds:
                return False
    return True


def source_signature(node):
    """The signature a ``def`` in upstream's source declares (decorators may hide it from inspect)."""
    kinds = inspect.Parameter
    args = node.args
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)
    params = [
        kinds(a.arg, kinds.POSITIONAL_ONLY if a in args.posonlyargs else kinds.POSITIONAL_OR_KEYWORD,
              default=kinds.empty if i < first_default else ast.unparse(args.defaults[i - first_default]))
        for i, a in enumerate(positional)
    ]
    if args.vararg:
        params.append(kinds(args.vararg.arg, kinds.VAR_POSITIONAL))
    params += [
        kinds(a.arg, kinds.KEYWORD_ONLY, default=kinds.empty if d is None else ast.unparse(d))
        for a, d in zip(args.kwonlyargs, args.kw_defaults)
    ]
    if args.kwarg:
        params.append(kinds(args.kwarg.arg, kinds.VAR_KEYWORD))
    return inspect.Signature(params)


def upstream_defs(tree):
    """{name: FunctionDef} for upstream's top-level functions and its classes' ``__init__``."""
    defs = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            defs[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    defs[node.name] = item
    return defs


@pytest.mark.parametrize("name", MODULES, ids=short)
def test_functions_and_constructors_upstream_defines_take_its_arguments(upstream, name):
    up, ours = upstream[name], ours_of(name)
    rows = []
    for attr, node in sorted(upstream_defs(up.tree).items()):
        mine = getattr(ours, attr, None)
        if isinstance(mine, type):
            mine = mine.__init__
        up_sig = source_signature(node)
        try:
            our_sig = inspect.signature(mine)
        except (TypeError, ValueError) as exc:
            rows.append((attr, f"upstream {up_sig}, ours has no signature ({exc})"))
            continue
        if not accepts_upstream_call(up_sig, our_sig):
            rows.append((attr, f"upstream {up_sig}, ours {our_sig}"))
    assert not rows, "calls to upstream's signatures would not bind to ours:\n" + table(rows, ("name", "signatures"))


def test_upstream_module_names_are_read_from_the_file(upstream):
    """The list is not hard-coded: a name a new upstream version adds is checked too."""
    offload = upstream["deepspeed.runtime.zero.parameter_offload"]
    coordinator = upstream["deepspeed.runtime.zero.partitioned_param_coordinator"]
    assert {"DeepSpeedZeRoOffload", "ZeROOrderedDict", "FWD_MODULE_STACK", "_inject_parameters"} <= offload.defined
    assert {"print_rank_0", "logger", "torch", "ZeroParamStatus", "iter_params", "GatheredParameters"} <= (
        offload.names - offload.defined)
    assert offload.from_overlaid["iter_params"] == "deepspeed.runtime.zero.partitioned_param_coordinator"
    assert {"PartitionedParameterCoordinator", "get_all_parameters", "ZeRoTraceMode", "ENABLE_PROFILER"} <= (
        coordinator.defined)


# ---------------------------------------------------------------------------- what the added names do


def po():
    return ours_of("deepspeed.runtime.zero.parameter_offload")


def pc():
    return ours_of("deepspeed.runtime.zero.partitioned_param_coordinator")


def forward_reading(param):
    """A module whose ZeROOrderedDict is in forward, holding ``param`` as ``weight``, as the engine sets it."""
    module = torch.nn.Module()
    params = po().ZeROOrderedDict(parent_module=module)
    params["weight"] = param
    params._in_forward = True
    module._parameters = params
    return module


def test_getter_gather_announces_itself_through_parameter_offload_print_rank_0(monkeypatch):
    param = zparam(7, 3)
    gathers = []

    def all_gather():
        gathers.append(param.ds_id)
        param.ds_status = ZeroParamStatus.AVAILABLE

    param.all_gather = all_gather
    printed = []
    monkeypatch.setattr(po(), "print_rank_0", lambda message, **kwargs: printed.append((message, kwargs)))
    module = forward_reading(param)

    assert module._parameters["weight"] is param
    assert module._parameters["weight"] is param  # available now: no second gather, no second line
    assert gathers == [7]
    assert printed == [("Registering external parameter from getter weight ds_id = 7", {"force": False})]


def test_getter_outside_forward_neither_gathers_nor_prints(monkeypatch):
    param = zparam(7, 3)
    param.all_gather = lambda: pytest.fail("gathered outside a forward")
    monkeypatch.setattr(po(), "print_rank_0", lambda *a, **k: pytest.fail("printed outside a forward"))
    module = forward_reading(param)
    module._parameters._in_forward = False
    assert module._parameters["weight"] is param


def test_apply_forward_and_backward_to_tensors_only_visits_tensors_in_nested_tuples():
    seen, grads = [], []
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3)
    outputs = (a * 2, ((b, "text"), ), 5)
    result = po()._apply_forward_and_backward_to_tensors_only(None, seen.append, grads.append, outputs)

    assert result[0] is outputs[0] and result[1][0][0] is b and result[1][0][1] == "text" and result[2] == 5
    assert [t.shape for t in seen] == [(2, ), (3, )]
    result[0].sum().backward()
    assert len(grads) == 1 and torch.equal(grads[0], torch.ones(2))  # b needs no grad: no hook


def test_inject_parameters_wraps_every_module_once_and_keeps_the_original_container():
    root = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    originals = [m._parameters for m in root.modules()]
    po()._inject_parameters(root, po().ZeROOrderedDict)
    po()._inject_parameters(root, po().ZeROOrderedDict)
    for module, original in zip(root.modules(), originals):
        assert isinstance(module._parameters, po().ZeROOrderedDict)
        assert module._parameters._parent_module is module
        assert module._original_parameters is original
        assert dict(module._parameters) == dict(original)


def test_inject_parameters_with_another_container_class():
    root = torch.nn.Linear(2, 2)
    original = root._parameters
    po()._inject_parameters(root, dict)
    assert type(root._parameters) is dict and root._parameters is not original
    assert list(root._parameters) == ["weight", "bias"] and root._original_parameters is original


def test_get_all_parameters_pairs_own_and_external_parameters():
    own, external = zparam(1, 2), zparam(2, 3)
    module = zmodule(10, own, external=[external])
    assert list(pc().get_all_parameters(module)) == [("p0", own), ("ext0", external)]
    assert list(pc().iter_params(module)) == [own, external]


def test_trace_mode_enum_has_upstream_members():
    assert [(m.name, m.value) for m in pc().ZeRoTraceMode] == [("RECORD", 1), ("COMPLETE", 2), ("INVALID", 3)]


def test_update_recompute_parameters_attributes_the_parameter_to_the_module(monkeypatch):
    """Upstream's bookkeeping: the parameter joins the module's ds_recompute_parameters, with upstream's debug line
    through the served module's print_rank_0 (looked up at call time, so a patch applies)."""
    lines = []
    monkeypatch.setattr(pc(), "print_rank_0", lambda message, force=False: lines.append(message))
    module, param = zmodule(10), zparam(1, 2)
    pc().update_recompute_parameters(module, param)
    pc().update_recompute_parameters(module, param)
    assert module.ds_recompute_parameters == {param}
    assert lines == ["update_recompute_parameters  sub_module.ds_id=10 to param.ds_id=1"] * 2


def test_enable_profiler_builds_upstreams_profiler_over_the_timers(monkeypatch):
    coordinator = pc()
    assert coordinator.ENABLE_PROFILER is False

    def build():
        return coordinator.PartitionedParameterCoordinator(prefetch_bucket_sz=0,
                                                           max_reuse_distance_in_numel=0,
                                                           max_available_parameters_in_numel=0,
                                                           allgather_stream=None,
                                                           inflight_param_registry=coordinator.InflightParamRegistry(),
                                                           timers="the engine's timers")

    assert build().events is None
    monkeypatch.setattr(coordinator, "ENABLE_PROFILER", True)
    events = build().events
    assert isinstance(events.profiler, coordinator.PartitionedParameterProfiler)
    assert events.profiler.timers == "the engine's timers"
    assert coordinator.PartitionedParameterCoordinator.BACKWARD_ALL_GATHER == "backward_all_gather"


def test_debug_rank0_logs_at_debug_level_on_rank_0(monkeypatch):
    records = []
    monkeypatch.setattr(pc().dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(pc().logger, "debug", lambda message, *a, **k: records.append(message))
    pc().debug_rank0("hello")
    monkeypatch.setattr(pc().dist, "get_rank", lambda *a, **k: 1)
    pc().debug_rank0("not on rank 1")
    assert records == ["hello"]
