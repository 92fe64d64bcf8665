"""The overlay's activation: the .pth hook, the meta-path finder, the kill switch, the version check.

What happens at interpreter start can only be seen from a fresh interpreter, so most of these tests
run one. Each of those that imports deepspeed costs several seconds, so there are few of them and
each checks everything its interpreter can show; the rest run in this process.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest

from deepspeed_zero3 import __version__, activation
from deepspeed_zero3._compat import OVERLAID_MODULES, SUPPORTED_DEEPSPEED_VERSIONS, describe_supported

REPO = Path(__file__).resolve().parents[2]
PTH_SOURCE = REPO / "src" / "deepspeed_zero3_activate.pth"
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()
OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
# The release this venv holds (make test DEEPSPEED_VERSION=... picks it); it must be one of the supported set.
SUPPORTED = activation.installed_deepspeed_version()
assert SUPPORTED in SUPPORTED_DEEPSPEED_VERSIONS, (SUPPORTED, SUPPORTED_DEEPSPEED_VERSIONS)
SUPPORTED_LIST = describe_supported()
RANGE = "0.16.0-0.19.8"
SKIPPED = "deepspeed-zero3: activation skipped ("


def run_python(args, cwd, env=None, timeout=180):
    """Run this interpreter (the venv's, whose site-packages holds the installed .pth) in a clean environment."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("DEEPSPEED_ZERO3", "PYTHONPATH")}
    full_env["DS_ACCELERATOR"] = "cpu"
    full_env.update(env or {})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def result_of(proc):
    """The JSON a script printed on its ``RESULT`` line (deepspeed may print other lines)."""
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(lines[0][len("RESULT "):])


def under(path, folder):
    return Path(path).resolve().is_relative_to(folder)


# ---------------------------------------------------------------------------- overlay on (a)

OVERLAY_ACTIVE_SCRIPT = r"""
import json, sys
at_start = {name: name in sys.modules for name in ("deepspeed_zero3.activation", "torch", "deepspeed")}
# PathFinder sits in sys.meta_path as a class, OverlayFinder as an instance.
finders = [(f if isinstance(f, type) else type(f)).__name__ for f in sys.meta_path]
import deepspeed_zero3
import deepspeed_zero3.activation
version = deepspeed_zero3.__version__
after_package = {name: name in sys.modules for name in ("torch", "deepspeed")}

# One of our runtime modules, and the public stats API, before deepspeed: the order that once
# failed with a circular ImportError (deepspeed's __init__ imports the overlaid parameter_offload).
import deepspeed_zero3.runtime.zero.trace
from deepspeed_zero3 import get_zero3_stats
import deepspeed
import deepspeed.runtime.zero.parameter_offload as m_offload
import deepspeed_zero3.runtime.zero.parameter_offload as o_offload
import deepspeed.runtime.zero.partitioned_param_coordinator as m_coord
import deepspeed_zero3.runtime.zero.partitioned_param_coordinator as o_coord
print("RESULT " + json.dumps({
    "at_start": at_start,
    "finders": finders,
    "after_package": after_package,
    "offload_same": m_offload is o_offload,
    "coordinator_same": m_coord is o_coord,
    "offload_in_sys_modules": sys.modules["deepspeed.runtime.zero.parameter_offload"] is o_offload,
    "coordinator_in_sys_modules": sys.modules["deepspeed.runtime.zero.partitioned_param_coordinator"] is o_coord,
    "parent_attribute": deepspeed.runtime.zero.parameter_offload is o_offload,
    # deepspeed.runtime.zero exports the class on some releases only.
    "zero_package_class": getattr(deepspeed.runtime.zero, "DeepSpeedZeRoOffload", o_offload.DeepSpeedZeRoOffload)
                          is o_offload.DeepSpeedZeRoOffload,
    "engine_class": deepspeed.runtime.engine.DeepSpeedZeRoOffload is o_offload.DeepSpeedZeRoOffload,
    "offload_file": m_offload.__file__,
    "coordinator_file": m_coord.__file__,
}))
"""


def test_overlay_serves_our_modules_under_upstream_names(tmp_path):
    """Also imports one of our runtime modules before deepspeed, which must work (it once did not)."""
    result = result_of(run_python(["-c", OVERLAY_ACTIVE_SCRIPT], cwd=tmp_path))

    # The installed .pth ran at start: the finder is in place, and neither torch nor deepspeed was imported.
    assert result["at_start"] == {"deepspeed_zero3.activation": True, "torch": False, "deepspeed": False}
    assert "OverlayFinder" in result["finders"]
    assert result["finders"].index("OverlayFinder") < result["finders"].index("PathFinder")
    # Importing the package (and reading its version) stays cheap.
    assert result["after_package"] == {"torch": False, "deepspeed": False}

    assert result["offload_same"] is True
    assert result["coordinator_same"] is True
    assert result["offload_in_sys_modules"] is True
    assert result["coordinator_in_sys_modules"] is True
    assert result["parent_attribute"] is True
    # Upstream code importing the class by name gets ours.
    assert result["zero_package_class"] is True
    assert result["engine_class"] is True
    ours = SITE_PACKAGES / "deepspeed_zero3" / "runtime" / "zero"
    assert under(result["offload_file"], ours), result["offload_file"]
    assert under(result["coordinator_file"], ours), result["coordinator_file"]


def test_importing_the_package_does_not_import_torch(tmp_path):
    """Import the package, run the activation and decide, in an interpreter where nothing else ran (-S: no .pth)."""
    script = ("import sys\n"
              "sys.path.append(sys.argv[1])\n"
              "import deepspeed_zero3, deepspeed_zero3.activation as a\n"
              "a.install()\n"
              "print(deepspeed_zero3.__version__, a.overlay_decision(), callable(deepspeed_zero3.overlay_status))\n"
              "print(sorted(n for n in ('torch', 'deepspeed', 'numpy') if n in sys.modules))\n")
    proc = run_python(["-I", "-S", "-c", script, str(SITE_PACKAGES)], cwd=tmp_path)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{__version__} (True, 'deepspeed {SUPPORTED} is supported') True\n[]\n"


# ---------------------------------------------------------------------------- kill switch (b)

KILL_SWITCH_SCRIPT = r"""
import json, sys, sysconfig
import deepspeed
import deepspeed.runtime.zero.parameter_offload as m_offload
import deepspeed.runtime.zero.partitioned_param_coordinator as m_coord
print("RESULT " + json.dumps({
    "offload_file": m_offload.__file__,
    "coordinator_file": m_coord.__file__,
    "ours_loaded": sorted(name for name in sys.modules if name.startswith("deepspeed_zero3.runtime")),
    "engine_class_module": deepspeed.runtime.engine.DeepSpeedZeRoOffload.__module__,
    "engine_class_file": sys.modules[deepspeed.runtime.engine.DeepSpeedZeRoOffload.__module__].__file__,
}))
"""


def test_kill_switch_leaves_upstream_untouched(tmp_path):
    result = result_of(run_python(["-c", KILL_SWITCH_SCRIPT], cwd=tmp_path, env={"DEEPSPEED_ZERO3": "0"}))

    upstream = SITE_PACKAGES / "deepspeed" / "runtime" / "zero"
    assert Path(result["offload_file"]).resolve() == upstream / "parameter_offload.py"
    assert Path(result["coordinator_file"]).resolve() == upstream / "partitioned_param_coordinator.py"
    assert under(result["engine_class_file"], SITE_PACKAGES / "deepspeed"), result["engine_class_file"]
    assert result["ours_loaded"] == []


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no ", "False"])
def test_kill_switch_values_turn_the_overlay_off(monkeypatch, value):
    monkeypatch.setenv("DEEPSPEED_ZERO3", value)
    monkeypatch.setattr(activation, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these may warn
        assert activation.kill_switch_state() == (False, f"DEEPSPEED_ZERO3={value} (kill switch)")
        assert activation.overlay_decision() == (False, f"DEEPSPEED_ZERO3={value} (kill switch)")
        for name in OVERLAID_MODULES:
            assert activation.OverlayFinder().find_spec(name) is None


@pytest.mark.parametrize("value", ["", "1", "true", "ON", "yes"])
def test_kill_switch_on_values_keep_the_overlay_on_silently(monkeypatch, value):
    monkeypatch.setenv("DEEPSPEED_ZERO3", value)
    monkeypatch.setattr(activation, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation.kill_switch_state() == (True, f"DEEPSPEED_ZERO3={value}")
        assert activation.overlay_decision() == (True, f"deepspeed {SUPPORTED} is supported")


# ---------------------------------------------------------------------------- unknown kill-switch value (f)


KILL = "DEEPSPEED_ZERO3"


def test_unknown_kill_switch_value_keeps_the_overlay_on_for_initialize_to_refuse(monkeypatch):
    """One policy for our environment variables: a bad value is a ValueError at initialize (the coordinator calls
    check_kill_switch), never a guess at import, where raising would break ``import deepspeed``."""
    monkeypatch.setenv("DEEPSPEED_ZERO3", "maybe")
    finder = activation.OverlayFinder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        specs = [finder.find_spec(name) for name in OVERLAID_MODULES] * 2
        decision = activation.overlay_decision()

    assert decision == (True, f"deepspeed {SUPPORTED} is supported")
    assert [type(s.loader).__name__ for s in specs] == ["_AliasLoader"] * 4
    assert [s.loader.impl_name for s in specs[:2]] == list(OVERLAID_MODULES.values())
    assert [s.name for s in specs[:2]] == list(OVERLAID_MODULES)
    assert [str(w.message) for w in caught if "deepspeed-zero3" in str(w.message) or KILL in str(w.message)] == []
    with pytest.raises(ValueError) as info:
        activation.check_kill_switch({"DEEPSPEED_ZERO3": "maybe"})
    assert str(info.value) == ("DEEPSPEED_ZERO3='maybe' is not allowed: use 1 (or unset) for deepspeed-zero3's "
                               "runtime, or 0 for upstream's runtime untouched")
    for fine in ({}, {"DEEPSPEED_ZERO3": "0"}, {"DEEPSPEED_ZERO3": " On "}, {"DEEPSPEED_ZERO3": ""}):
        activation.check_kill_switch(fine)


def test_finder_ignores_every_other_name():
    finder = activation.OverlayFinder()
    for name in ("deepspeed", "deepspeed.runtime.zero", "deepspeed.runtime.zero.stage3",
                 "deepspeed.runtime.zero.parameter_offload_extra", "deepspeed_zero3.runtime.zero.parameter_offload"):
        assert finder.find_spec(name) is None


def test_install_is_idempotent(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    count = sum(type(f).__name__ == "OverlayFinder" for f in sys.meta_path)
    assert count == 1  # the .pth installed it at start
    activation.install()
    activation.install()
    assert sum(type(f).__name__ == "OverlayFinder" for f in sys.meta_path) == 1


# ---------------------------------------------------------------------------- unsupported deepspeed version (c)

UNSUPPORTED_VERSION_SCRIPT = r"""
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from deepspeed_zero3 import __version__, activation
    from deepspeed_zero3._compat import OVERLAID_MODULES
    installed = activation.installed_deepspeed_version()
    import deepspeed
    import deepspeed.runtime.zero.parameter_offload as m_offload
    import deepspeed.runtime.zero.partitioned_param_coordinator as m_coord
    finder = activation.OverlayFinder()
    specs = [finder.find_spec(name) for name in OVERLAID_MODULES] * 2
    decision = activation.overlay_decision()
print("RESULT " + json.dumps({
    "installed": installed,
    "specs": [repr(s) for s in specs],
    "decision": decision,
    "offload_file": m_offload.__file__,
    "coordinator_file": m_coord.__file__,
    "ours_loaded": sorted(name for name in sys.modules if name.startswith("deepspeed_zero3.runtime")),
    "runtime_warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
}))
"""


def fake_deepspeed_metadata(folder, version):
    dist_info = folder / f"deepspeed-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n")
    return folder


def test_unsupported_deepspeed_version_warns_once_and_runs_upstream(tmp_path):
    fake = fake_deepspeed_metadata(tmp_path / "fake", "9.9.9")
    result = result_of(run_python(["-c", UNSUPPORTED_VERSION_SCRIPT], cwd=tmp_path, env={"PYTHONPATH": str(fake)}))

    # The fake metadata comes first on sys.path, so it is what the version check reads.
    assert result["installed"] == "9.9.9"
    assert result["specs"] == ["None"] * 4
    assert result["decision"] == [False, f"deepspeed 9.9.9 is not a supported version ({RANGE})"]
    upstream = SITE_PACKAGES / "deepspeed" / "runtime" / "zero"
    assert Path(result["offload_file"]).resolve() == upstream / "parameter_offload.py"
    assert Path(result["coordinator_file"]).resolve() == upstream / "partitioned_param_coordinator.py"
    assert result["ours_loaded"] == []
    assert result["runtime_warnings"] == [
        f"deepspeed-zero3 supports deepspeed {RANGE}, but deepspeed 9.9.9 is installed; the overlay is off "
        f"and upstream's ZeRO-3 runtime runs unmodified. Install a supported release to use it."
    ]


def test_the_supported_set_is_every_release_from_0_16_0_to_0_19_8():
    last_patch = {16: 9, 17: 6, 18: 9, 19: 8}
    assert SUPPORTED_DEEPSPEED_VERSIONS == tuple(f"0.{minor}.{patch}" for minor, last in last_patch.items()
                                                 for patch in range(last + 1))
    assert len(SUPPORTED_DEEPSPEED_VERSIONS) == 36
    assert describe_supported() == RANGE
    assert describe_supported(("0.19.4", "0.19.5", "0.19.6", "0.19.7", "0.19.8")) == "0.19.4-0.19.8"
    assert describe_supported(("0.18.8", "0.18.9", "0.19.0", "0.19.1")) == "0.18.8, 0.18.9, 0.19.0, 0.19.1"
    assert describe_supported(("0.19.8", )) == "0.19.8"
    assert describe_supported(("0.19.4", "0.19.6", "0.19.8")) == "0.19.4, 0.19.6, 0.19.8"


@pytest.mark.parametrize("version", SUPPORTED_DEEPSPEED_VERSIONS)
def test_every_supported_version_turns_the_overlay_on_silently(monkeypatch, version):
    monkeypatch.delenv("DEEPSPEED_ZERO3", raising=False)
    monkeypatch.setattr(activation, "_warned", set())
    monkeypatch.setattr(activation, "installed_deepspeed_version", lambda: version)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert activation.overlay_decision() == (True, f"deepspeed {version} is supported")
        assert activation.OverlayFinder().find_spec(OFFLOAD) is not None


# Just below and above the range, a later minor, and a dev build of a supported release: membership, not a span.
@pytest.mark.parametrize("version", ["0.15.4", "0.19.9", "0.20.0", "0.19.8+abc123"])
def test_a_version_outside_the_supported_set_warns_once_and_runs_upstream(monkeypatch, version):
    monkeypatch.delenv("DEEPSPEED_ZERO3", raising=False)
    monkeypatch.setattr(activation, "_warned", set())
    monkeypatch.setattr(activation, "installed_deepspeed_version", lambda: version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = [activation.overlay_decision() for _ in range(3)]
        specs = [activation.OverlayFinder().find_spec(name) for name in OVERLAID_MODULES]

    assert decisions == [(False, f"deepspeed {version} is not a supported version ({RANGE})")] * 3
    assert specs == [None, None]
    assert [str(w.message) for w in caught] == [
        f"deepspeed-zero3 supports deepspeed {RANGE}, but deepspeed {version} is installed; the overlay is "
        f"off and upstream's ZeRO-3 runtime runs unmodified. Install a supported release to use it."
    ]


def setup_py_functions():
    """setup.py's functions, run alone (setup() itself would build)."""
    import ast
    source = (REPO / "setup.py").read_text()
    namespace = {"ast": ast, "os": os, "__file__": str(REPO / "setup.py")}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            exec(ast.get_source_segment(source, node), namespace)
    return namespace


def test_setup_py_requires_the_span_of_the_supported_set():
    assert setup_py_functions()["supported_deepspeed_requirement"]() == "deepspeed>=0.16.0,<=0.19.8"


def test_setup_py_requires_the_measured_torch_series():
    """The torch range follows the measured matrix, which is the Makefile's TORCH_VERSIONS."""
    from deepspeed_zero3._compat import MEASURED_TORCH_VERSIONS
    assert setup_py_functions()["measured_torch_requirement"]() == "torch>=2.11,<2.16"
    makefile = (REPO / "Makefile").read_text()
    line = next(line for line in makefile.splitlines() if line.startswith("TORCH_VERSIONS := "))
    assert tuple(line.split(":= ")[1].split()) == MEASURED_TORCH_VERSIONS


def test_missing_deepspeed_turns_the_overlay_off(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_ZERO3", raising=False)
    monkeypatch.setattr(activation, "installed_deepspeed_version", lambda: None)
    assert activation.overlay_decision() == (False, "deepspeed is not installed")
    assert activation.OverlayFinder().find_spec(OFFLOAD) is None


# ---------------------------------------------------------------------------- python -m deepspeed_zero3 (d)


def module_lines(lines):
    """``  name -> path`` lines of the status output, as {name: resolved path}."""
    pairs = [line.strip().split(" -> ") for line in lines]
    assert all(len(pair) == 2 for pair in pairs), lines
    return {name: Path(origin).resolve() for name, origin in pairs}


def status_lines(stdout):
    """The command's own lines: deepspeed's logger prints to stdout too (before 0.17, at INFO when it picks the
    accelerator)."""
    return [line for line in stdout.splitlines() if not line.startswith("[20")]


def test_status_command_reports_active(tmp_path):
    proc = run_python(["-m", "deepspeed_zero3"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = status_lines(proc.stdout)
    assert lines[0] == f"deepspeed-zero3 {__version__}: overlay ACTIVE (deepspeed {SUPPORTED} is supported)"
    assert lines[1] == f"upstream deepspeed: {SUPPORTED} (supported: {SUPPORTED_LIST})"
    ours = SITE_PACKAGES / "deepspeed_zero3" / "runtime" / "zero"
    assert module_lines(lines[2:]) == {
        COORDINATOR: ours / "partitioned_param_coordinator.py",
        OFFLOAD: ours / "parameter_offload.py",
    }


def test_status_command_reports_kill_switch(tmp_path):
    proc = run_python(["-m", "deepspeed_zero3"], cwd=tmp_path, env={"DEEPSPEED_ZERO3": "0"})
    assert proc.returncode == 0, proc.stderr
    lines = status_lines(proc.stdout)
    assert lines[0] == f"deepspeed-zero3 {__version__}: overlay INACTIVE (DEEPSPEED_ZERO3=0 (kill switch))"
    assert lines[1] == f"upstream deepspeed: {SUPPORTED} (supported: {SUPPORTED_LIST})"
    upstream = SITE_PACKAGES / "deepspeed" / "runtime" / "zero"
    assert module_lines(lines[2:]) == {
        COORDINATOR: upstream / "partitioned_param_coordinator.py",
        OFFLOAD: upstream / "parameter_offload.py",
    }


# ---------------------------------------------------------------------------- a broken install never breaks start (e)


def test_pth_line_survives_a_missing_or_broken_package(tmp_path):
    """site.addsitedir runs the .pth exactly as interpreter start does, in an interpreter without the venv."""
    missing = tmp_path / "missing"  # the .pth without the package next to it
    missing.mkdir()
    shutil.copy(PTH_SOURCE, missing / PTH_SOURCE.name)
    broken = tmp_path / "broken"  # the .pth next to a package whose activation module raises
    (broken / "deepspeed_zero3").mkdir(parents=True)
    shutil.copy(PTH_SOURCE, broken / PTH_SOURCE.name)
    (broken / "deepspeed_zero3" / "__init__.py").write_text("")
    (broken / "deepspeed_zero3" / "activation.py").write_text("raise RuntimeError('activation is broken')\n")
    script = ("import site, sys\n"
              "site.addsitedir(sys.argv[1])\n"
              "site.addsitedir(sys.argv[2])\n"
              "print('interpreter alive')\n")
    # -S: no site-packages (so the venv's deepspeed_zero3 is not importable); -I: no PYTHONPATH, no user site.
    proc = run_python(["-I", "-S", "-c", script, str(missing), str(broken)], cwd=tmp_path)

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "interpreter alive\n"
    assert "Error processing line" not in proc.stderr  # the .pth line itself caught the failure
    assert proc.stderr.splitlines() == [
        "deepspeed-zero3: activation skipped (ModuleNotFoundError(\"No module named 'deepspeed_zero3'\")); "
        "upstream DeepSpeed runs unmodified",
        "deepspeed-zero3: activation skipped (RuntimeError('activation is broken')); upstream DeepSpeed runs unmodified",
    ]


def test_broken_package_shadowing_the_install_does_not_break_start(tmp_path):
    """At a real interpreter start, the installed .pth imports a broken deepspeed_zero3 found first on PYTHONPATH."""
    (tmp_path / "deepspeed_zero3").mkdir()
    (tmp_path / "deepspeed_zero3" / "__init__.py").write_text("")
    (tmp_path / "deepspeed_zero3" / "activation.py").write_text("def install():\n    raise OSError('no can do')\n")
    script = ("import sys\n"
              "print([type(f).__name__ for f in sys.meta_path].count('OverlayFinder'))\n")
    proc = run_python(["-c", script], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0\n"
    # CPython 3.11's site.main() processes a venv's site-packages twice (venv() and then addsitepackages()),
    # so every .pth line runs twice there; install() is idempotent, and the message may appear twice.
    lines = proc.stderr.splitlines()
    assert 1 <= len(lines) <= 2, proc.stderr
    assert set(lines) == {"deepspeed-zero3: activation skipped (OSError('no can do')); upstream DeepSpeed runs unmodified"}


def test_status_check_exits_non_zero_only_when_inactive(tmp_path):
    active = run_python(["-m", "deepspeed_zero3", "--check"], cwd=tmp_path)
    inactive = run_python(["-m", "deepspeed_zero3", "--check"], cwd=tmp_path, env={"DEEPSPEED_ZERO3": "0"})
    assert (active.returncode, inactive.returncode) == (0, 1), (active.stderr, inactive.stderr)
    assert "overlay INACTIVE" in inactive.stdout


def test_status_help_describes_the_command(tmp_path):
    proc = run_python(["-m", "deepspeed_zero3", "--help"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m deepspeed_zero3 [-h] [--check]")
    assert "--check" in proc.stdout and "exit with status 1 when the overlay is inactive" in proc.stdout
