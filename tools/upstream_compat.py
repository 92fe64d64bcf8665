"""Upstream DeepSpeed's own ZeRO-3 unit tests under both runtimes: ``make compat UPSTREAM=<checkout>``.

Copies ``<checkout>/tests`` into a scratch directory (``compat-out/`` by default, never into this repository:
we run upstream's tests, we do not ship them), selects the stage-3 tests of the directories in ``TEST_DIRS``,
runs each file under upstream (``DEEPSPEED_ZERO3=0``) and under ours (``DEEPSPEED_ZERO3=1``), one pytest
process per file and runtime, one at a time, and rebuilds ``docs/compat/upstream-unit-tests.md`` from the
results, which it keeps in ``docs/compat/upstream-unit-tests.json``.

[Note: a release of the compat table]
The table is only as good as the run behind it, so the page is one full run on one commit of this
repository, named on the page with the pytest it ran under, the shims and the CPU's fp16 support: a full
run starts from an empty store and keeps no row of an earlier run (``--resume`` continues a stopped run
only while nothing it measures, ``MEASURED_PATHS``, changed since its commit, under the same pytest and
shims). A partial run (``--files``) writes its own table under the work directory, never the docs. A
test that did not report (its pytest crashed or timed out) is counted *not run*, with why, unless it
reports when run alone ([Note: a test run alone]); a module that skips itself at collection on this
machine (fp16 tests on a CPU without fp16) is listed as not applicable here instead of being dropped.

Only ``tests/`` is copied: upstream's ``tests/conftest.py`` puts the directory above it on ``sys.path``, and
a checkout's ``deepspeed/`` there would shadow the installed deepspeed that both runtimes must share.

The same file is the pytest plugin (``-p upstream_compat``) that classifies and selects the tests inside
those pytest processes; see ``is_stage3`` for the rule.

Usage (from the repository root; the whole suite takes about an hour per runtime on 2 cores):

    python tools/upstream_compat.py --upstream <checkout>                  # a release: every file
    python tools/upstream_compat.py --upstream <checkout> --collect-only   # counts only
    python tools/upstream_compat.py --upstream <checkout> --files test_z3_eager_fallback.py   # a partial run
"""

import argparse
import contextlib
import datetime
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import compat_shims  # stdlib only at import, as the plugin needs
from deepspeed_zero3.testing.ports import shm_buffers  # stdlib only: cheap in the driver and in the plugin

REPO = Path(__file__).resolve().parent.parent
# Where upstream keeps its stage-3 tests, across releases (0.16's compile tests are in runtime/compile, later
# ones in v1/compile): a run takes those its checkout has.
TEST_DIRS = ("unit/v1/zero", "unit/runtime/zero", "unit/v1/compile", "unit/runtime/compile", "unit/checkpoint")
# A run recorded before runs named their directories ran these.
FORMER_TEST_DIRS = ("unit/v1/zero", "unit/runtime/zero", "unit/v1/compile", "unit/checkpoint")


def present_dirs(work: Path):
    """The TEST_DIRS the copied tests have, in order; an empty result names what was looked for."""
    found = [d for d in TEST_DIRS if (work / "tests" / d).is_dir()]
    if not found:
        raise SystemExit(f"upstream_compat: none of {', '.join('tests/' + d for d in TEST_DIRS)} in {work}")
    return found
RUNTIMES = {"upstream": "0", "ours": "1"}
TIMEOUT_GRACE_S = 120
ENV = {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4", "DS_UNITTEST_TIMEOUT": "300"}
SELECT_ENV = "ZERO3_COMPAT_SELECT"
COLLECT_ENV = "ZERO3_COMPAT_COLLECT"
OUTCOMES = ("P", "F", "S", "XF", "XP", "NR")
# [Note: the pytest upstream's tests run under]
# Upstream's requirements-dev.txt pins pytest>=7.2.0,<8.4.0, and its suite depends on that: DistributedFixture
# (unit/common.py) marks a class as a fixture through the `_pytestfixturefunction` attribute, which pytest 8.4
# stopped reading, so under this venv's pytest 9 every test taking one (the checkpoint tests of
# test_universal_checkpoint.py and test_zero_optimizer.py) errors "fixture 'baseline_ws2' not found" under both
# runtimes and measures nothing. The children run the newest pytest upstream allows, installed once into the
# work directory and put first on their PYTHONPATH; the driver and this venv keep theirs.
UPSTREAM_PYTEST = "8.3.5"

# Tests that pass with upstream and fail with ours on purpose: (category, node-id regex, regex of our failure
# text or None, why). Explained at length in docs/compat/upstream-differences.md.
ON_PURPOSE = [
    ("b", r"test_zero\.py::TestZero3ParamPartitioningBase::test_prefetching\[True\]", None,
     "asserts that upstream's single forward+backward prefetch trace keeps layer1.weight gathered between its "
     "forward and backward uses (reuse distance 0); our forward prefetcher stops at the end of the forward"),
    ("b", r"test_zero_hook_attribute_delegation\.py::TestHookAttributeDelegation", None,
     "asserts upstream's per-module hook attributes (pre_bwd_fn, post_bwd_fn, applied_pre_backward_ref_cnt); "
     "ours keeps that state in the module tree's registry"),
    ("b", r"test_zero_linear_direct_init\.py::TestZero3LinearDirectInit::test_wrapper_and_parameter_storage_lifecycle",
     None, "asserts the weight of a one-Linear model is released after its first forward; ours keeps it for the "
     "backward that needs it at once (a model under one bucket): parity scenario single_linear_root_memory_efficient"),
    ("d", r"test_zero_leaf_module\.py::TestSetZ3LeafModule::test_no_grad_input_error", None,
     "expects upstream's failure for a z3-leaf root with inputs that need no grad; ours trains, bitwise equal to "
     "upstream with the inputs requiring grad: parity scenario z3_leaf_root_no_grad_inputs"),
]

# Tests upstream fails with an error of its own runtime code on this CPU, in a release that later fixed it, and
# ours passes: (node-id regex, regex of upstream's failure text, why). Category (u).
UPSTREAM_FAILS = [
    (r"test_zero_leaf_module\.py::TestZ3LeafOptimization::test_finegrained_optimization",
     r"Invalid device string: '\d+'",
     "upstream's release_sub_module allocates torch.empty(1, device=get_accelerator().current_device()), and the CPU "
     "accelerator's current device is the string '0', which torch refuses (0.19.8 names the device with "
     "current_device_name()); ours allocates no such buffer"),
]

# Tests that fail at random under both runtimes here, measured by hand beyond the automatic repeats of
# [Note: a test run alone]: (node-id regex, why with the runs). Category (r).
RANDOM_UNDER_BOTH = [
    (r"test_universal_checkpoint\.py::TestZeROUniversalCheckpointDP::test_dp_world_size_\w+"
     r"\[(\w+-\w+-3-dtype1|\w+-True-3-dtype\d)\]",
     "the fp16 variants and those training with torch.optim.Adam (lr 0.1, unseeded random data): one rank's "
     "compare_state_dicts of the loaded universal checkpoint against the state saved before the conversion fails "
     "(values apart by up to 0.63, or NaN in both) while the other goes on into training and waits in its next "
     "collective until the test is killed. Run alone on 0.16.9: 2to2[False-True-3-dtype1] failed so in 1 of 6 "
     "runs under upstream and 4 of 9 under ours, 4to2[False-True-3-dtype2] in 2 of 4 under upstream and 2 of 5 "
     "under ours"),
]


def listed_why(table, nodeid: str):
    """The why of the first (node-id regex, why) entry of ``table`` that matches ``nodeid``, or None."""
    return next((why for pattern, why in table if re.search(pattern, nodeid)), None)

# ------------------------------------------------------------------------------------------ pytest plugin

STAGE_PARAMS = ("zero_stage", "stage")
STAGE3_TEXT = re.compile(r"""["']stage["']\s*:\s*3\b|\bzero_stage\s*=\s*3\b|\bstage\s*=\s*3\b|\bstage3_|"""
                         r"""zero\.Init\b|GatheredParameters|ZeroParamStatus|\bds_status\b|DeepSpeedZeRoOffload|"""
                         r"""parameter_offload|partitioned_param_coordinator|\bZero3|\bzero3|\bz3_|ZeRO-3""")


def stage_param(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    return next(((name, params[name]) for name in STAGE_PARAMS if name in params), None)


def is_stage3(item, module_has_stage_params: bool):
    """(stage 3?, why) for a collected test. A ``zero_stage``/``stage`` parameter decides; without one, a
    stage-3 mark in the test's own source or its class's (a stage-3 config, ``zero.Init``, ZeRO-3 parameter
    status, ...); without one there either, a module named for ZeRO-3 (``z3``, ``zero3``, ``stage3``), or one
    with a stage-3 mark whose tests have no stage parameter at all (its configs are module-level helpers)."""
    param = stage_param(item)
    if param is not None:
        return str(param[1]) == "3", f"{param[0]}={param[1]}"
    module = getattr(item, "module", None)
    for what, obj in (("test", getattr(item, "function", None)), ("class", getattr(item, "cls", None)),
                      ("module", None if module_has_stage_params else module)):
        if obj is None:
            continue
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            continue
        found = STAGE3_TEXT.search(source)
        if found:
            return True, f"{what} source: {found.group(0)!r}"
    name = getattr(module, "__name__", "")
    if re.search(r"z3|zero3|stage3", name):
        return True, f"module {name}"
    return False, "no stage-3 parameter or source mark"


def pytest_report_header(config):
    import pytest
    from deepspeed.runtime.zero import parameter_offload
    return [f"{RUNTIME_LINE}{parameter_offload.__file__}", f"{PYTEST_LINE}{pytest.__version__}"]


RUNTIME_LINE = "upstream_compat: parameter_offload from "
PYTEST_LINE = "upstream_compat: pytest "
_collect_errors = []
_collect_skips = []
_marker_deselected = []


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append({"nodeid": report.nodeid, "error": str(report.longrepr)[-1500:]})
    elif report.skipped:  # a module that skips itself at collection (pytest.skip(..., allow_module_level=True))
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _collect_skips.append({"nodeid": report.nodeid, "reason": str(reason).removeprefix("Skipped: ")[:300]})


def pytest_deselected(items):
    _marker_deselected.extend(i.nodeid for i in items)


def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get(SELECT_ENV)
    if not path:
        return
    keep = set(json.loads(Path(path).read_text()))
    deselected = [i for i in items if i.nodeid not in keep]
    items[:] = [i for i in items if i.nodeid in keep]
    if deselected:
        config.hook.pytest_deselected(items=deselected)


def pytest_collection_finish(session):
    path = os.environ.get(COLLECT_ENV)
    if not path:
        return
    records = []
    with_stage_params = {item.nodeid.split("::", 1)[0] for item in session.items if stage_param(item) is not None}
    for item in session.items:
        stage3, why = is_stage3(item, item.nodeid.split("::", 1)[0] in with_stage_params)
        records.append({"nodeid": item.nodeid, "stage3": stage3, "why": why})
    Path(path).write_text(
        json.dumps({
            "items": records,
            "errors": _collect_errors,
            "skipped_modules": _collect_skips,
            "marker_deselected": len(_marker_deselected)
        }, indent=1))


# ------------------------------------------------------------------------------------------ the driver


def log(message):
    print(f"[compat {datetime.datetime.now(datetime.timezone.utc):%H:%M:%S}] {message}", flush=True)


def wait_while_paused(work: Path) -> None:
    """Hold before the next file while ``<work>/PAUSE`` exists: timing benchmarks on this 2-core machine need
    it to themselves, and a test stopped mid-run (SIGSTOP) would hit upstream's wall-clock test timeout."""
    pause = work / "PAUSE"
    if pause.exists():
        log(f"paused: remove {pause} to go on")
        while pause.exists():
            time.sleep(5)
        log("going on")


def upstream_revision(upstream: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(upstream), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        marker = upstream / "COMMIT"
        return marker.read_text().strip() if marker.exists() else "unknown"


def prepare(upstream: Path, work: Path, shims: bool) -> dict:
    if not (upstream / "tests" / "unit").is_dir():
        sys.exit(f"--upstream {upstream}: no tests/unit there; pass a DeepSpeed source checkout (e.g. from "
                 f"`git archive <tag> tests | tar -x -C DIR`)")
    tests = work / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(upstream / "tests", tests)
    if shims:
        compat_shims.apply(tests)  # [Note: CPU shims for upstream's test helpers]
    version = upstream / "version.txt"
    return {
        "commit": upstream_revision(upstream),
        "version_txt": version.read_text().strip() if version.exists() else "unknown",
        "dirs": present_dirs(work),
    }


def our_revision() -> dict:
    """This repository's commit, and the runtime files that differ from it (a release measures a clean tree)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout

    changed = [line.split(maxsplit=1)[1] for line in git("status", "--porcelain", "--", "src", "tools", "setup.py",
                                                         "pyproject.toml").splitlines() if line.strip()]
    return {"commit": git("rev-parse", "--short=12", "HEAD").strip() or "unknown", "changed_files": changed}


def machine_dtypes() -> dict:
    """What decides which of upstream's tests apply here: the CPU accelerator's dtypes and the CPU's fp16 flags."""
    probe = ("from deepspeed.accelerator import get_accelerator; "
             "print(','.join(str(d).removeprefix('torch.') for d in get_accelerator().supported_dtypes()))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=dict(os.environ, DS_ACCELERATOR="cpu"))
    dtypes = proc.stdout.strip().splitlines()[-1].split(",") if proc.returncode == 0 and proc.stdout.strip() else []
    flags = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return {"accelerator_dtypes": dtypes, "fp16": "float16" in dtypes,
            "cpu_flags": sorted(flags & {"avx512_fp16", "amx_fp16", "amx_bf16", "avx512_bf16", "amx_tile"})}


def install_pytest(work: Path, version: str):
    """The pytest the children import ([Note: the pytest upstream's tests run under]); None: this venv's."""
    if version == "installed":
        return None
    target = work / f"pytest-{version}"
    if not (target / "pytest").is_dir():
        log(f"installing pytest {version} into {target}")
        pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                              f"pytest=={version}"])
        if pip.returncode != 0:
            sys.exit(f"--pytest {version}: pip could not install pytest=={version} (exit {pip.returncode}); pass a "
                     f"released pytest version (upstream's suite needs one below 8.4; default {UPSTREAM_PYTEST}) "
                     "or 'installed' for this venv's")
    return target


def installed_pytest_version() -> str:
    from importlib.metadata import version
    return version("pytest")


def child_env(runtime: str, pytest_dir=None, **extra) -> dict:
    env = dict(os.environ, **ENV)
    env.update(DEEPSPEED_ZERO3=RUNTIMES[runtime], **extra)
    paths = (str(REPO / "tools"), str(pytest_dir) if pytest_dir else None, env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def collect(work: Path, runtime: str, timeout: int, pytest_dir) -> dict:
    out = work / f"collect.{runtime}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_compat", "--collect-only",
               "-q"] + [f"tests/{d}" for d in present_dirs(work)]
    log(f"collecting under {runtime}")
    proc = subprocess.run(command, cwd=work, env=child_env(runtime, pytest_dir, **{COLLECT_ENV: str(out)}),
                          timeout=timeout, capture_output=True, text=True)
    (work / "logs").mkdir(exist_ok=True)
    (work / "logs" / f"collect.{runtime}.log").write_text(proc.stdout + proc.stderr)
    if not out.exists():
        sys.exit(f"collection under {runtime} wrote nothing (rc {proc.returncode}); see {work}/logs/collect.{runtime}.log")
    return json.loads(out.read_text())


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def junit_key(nodeid: str):
    """pytest's junit (classname, name) of a node id 'unit/x/test_f.py::Class::test[p]'."""
    path, *rest = nodeid.split("::")
    dotted = path[:-3].replace("/", ".")
    return ".".join([dotted] + rest[:-1]), rest[-1]


def read_junit(xml: Path, nodeids) -> dict:
    """{nodeid: (outcome, message)}; tests missing from the XML are left out (not run)."""
    if not xml.exists():
        return {}
    wanted = {junit_key(n): n for n in nodeids}
    results = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        nodeid = wanted.get((case.get("classname"), case.get("name")))
        if nodeid is None:
            continue
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            text = (failure.get("message") or "") + "\n" + (failure.text or "")
            results[nodeid] = ("F", text[-4000:])
        elif skipped is not None:
            outcome = "XF" if skipped.get("type") == "pytest.xfail" else "S"
            results[nodeid] = (outcome, skipped.get("message") or "")
        else:
            results[nodeid] = ("P", "")
    return results


def file_stem(test_file: str) -> str:
    return test_file.replace("/", "_")[:-3]


def run_file(work: Path, test_file: str, nodeids, runtime: str, timeout: int, pytest_dir, label=None,
             env=None) -> dict:
    """Run ``nodeids`` of ``test_file`` in one pytest process; ``label`` names its logs (default: the file's)."""
    stem = label or file_stem(test_file)
    select = work / "select" / f"{stem}.json"
    select.parent.mkdir(exist_ok=True)
    select.write_text(json.dumps(sorted(nodeids)))
    xml = work / "junit" / f"{stem}.{runtime}.xml"
    xml.parent.mkdir(exist_ok=True)
    xml.unlink(missing_ok=True)
    basetemp = work / "tmp" / f"{stem}.{runtime}"
    basetemp.parent.mkdir(exist_ok=True)  # pytest makes --basetemp itself, not its parents
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_compat",
               f"--basetemp={basetemp}", f"--junitxml={xml}", "-rA", "--tb=long", f"tests/{test_file}"]
    log(f"{test_file}: {len(nodeids)} tests under {runtime}" + (f" ({stem})" if label else ""))
    (work / "logs").mkdir(exist_ok=True)
    shm_before = set(shm_buffers())
    log_path = work / "logs" / f"{stem}.{runtime}.log"
    with open(log_path, "w") as output:
        proc = subprocess.Popen(command, cwd=work, env=child_env(runtime, pytest_dir, **{SELECT_ENV: str(select)},
                                                              **(env or {})),
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        rc = wait_unless_hanged(proc, log_path, timeout)
        if rc in ("timeout", "hanged"):
            # SIGINT first: pytest stops, reports and writes the junit XML of the tests it finished, so a file
            # that overran keeps those; whatever is left of its process group is killed after a grace period.
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=TIMEOUT_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    # Upstream's CPU allreduce leaves a 66 MB buffer per rank and port in /dev/shm; each test picks its own port,
    # so a whole suite would fill the machine's memory. Only the buffers this file's run created are removed.
    for leftover in set(shm_buffers()) - shm_before:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(leftover)
    check_runtime(work / "logs" / f"{stem}.{runtime}.log", runtime, pytest_dir)
    results = read_junit(xml, nodeids)
    missing = [n for n in nodeids if n not in results]
    if missing:
        why = {"timeout": "timed out", "hanged": f"a test hanged: {HANGED_LINE}"}.get(rc, f"pytest exit {rc}")
        for nodeid in missing:
            results[nodeid] = ("NR", f"did not report ({why}; log compat-out/logs/{stem}.{runtime}.log)")
    log(f"{test_file} under {runtime}: rc {rc}, {counts(results)}")
    return results


# [Note: a test run alone]
# A file's tests share one pytest process, and some of upstream's files do not survive that on 2 cores: on
# 0.16.9 test_universal_checkpoint.py hung under both runtimes (upstream after 25 of its 36 tests, ours after
# 1), and every test after the hang counted as not run, which says nothing about either runtime. Some tests
# also fail at random under both (test_zero_optimizer.py's test_load_module_only[3] failed 1 of 5 runs alone
# under upstream and 1 of 3 under ours): one file run then shows a difference that is only chance. So a run
# has two more steps per file, under the same runtimes and timeouts, each test in its own pytest process:
# * a test that did not report in its file's run is run once alone; its outcome counts, and the page says
#   how many were run that way;
# * a test whose outcomes differ, not on purpose, is run alone REPEATS times under each runtime. If each
#   runtime shows the other's file-run outcome at least once, the page lists it as failing at random under
#   both, with the outcomes, and it is no longer unexplained; otherwise it stays a difference to explain,
#   with the outcomes (RANDOM_UNDER_BOTH then holds what was measured by hand beyond REPEATS).
# Nothing is retried to make a test pass: the file run's outcome stays in the counts for a repeated test.
# A test that passes alone takes under 30 s here, so a run alone gets upstream's per-test timeout at 180 s, not
# 300; and tests that hang here when run alone (NOT_RUN_ALONE) are not run alone at all: each would cost the
# outer timeout (upstream's fixtures have none) and measure nothing.
REPEATS = 3
ALONE_UNITTEST_TIMEOUT_S = 180
ALONE_TIMEOUT_S = ALONE_UNITTEST_TIMEOUT_S + 240
# (node-id regex, why): tests that hang here, so a test of them that did not report stays not run.
NOT_RUN_ALONE = [
    (r"test_zero_tensor_fragment\.py::.*\[nvme-",
     "NVMe optimizer offload hangs under both runtimes on this machine (0.16.9: the first nvme variant reached "
     "upstream's 300 s test timeout under each)"),
    (r"test_universal_checkpoint\.py::TestZeROUniversalCheckpointDP::test_dp_world_size_2to4\[",
     "upstream's own 2-to-4-rank conversion fails or hangs on this machine (0.16.9: its file run hung at the first "
     "2to4 variant; run alone, two variants failed with a bare AssertionError and the third hung in its 2-rank "
     "fixture, which has no timeout, until killed at 420 s)"),
]


def run_alone(work: Path, test_file: str, nodeid: str, runtime: str, pytest_dir, tag: str):
    label = f"{file_stem(test_file)}.{tag}.{zlib.crc32(nodeid.encode()):08x}"
    return run_file(work, test_file, [nodeid], runtime, ALONE_TIMEOUT_S, pytest_dir, label=label,
                    env={"DS_UNITTEST_TIMEOUT": str(ALONE_UNITTEST_TIMEOUT_S)})[nodeid]


def fill_not_reported(work: Path, test_file: str, per_runtime: dict, pytest_dir) -> dict:
    """Run each test that did not report alone, once; its outcome replaces the NR. {runtime: [nodeids]}."""
    alone = {}
    for rt, results in per_runtime.items():
        for nodeid in sorted(n for n, (outcome, _) in results.items() if outcome == "NR"):
            hangs = listed_why(NOT_RUN_ALONE, nodeid)
            if hangs:
                results[nodeid] = ("NR", f"{results[nodeid][1]}; not run alone: {hangs}")
                continue
            outcome, message = run_alone(work, test_file, nodeid, rt, pytest_dir, "alone")
            alone.setdefault(rt, []).append(nodeid)
            if outcome != "NR":
                results[nodeid] = (outcome, message)
            else:
                results[nodeid] = ("NR", results[nodeid][1] + "; did not report when run alone either")
    return alone


def repeat_differences(work: Path, test_file: str, per_runtime: dict, pytest_dir) -> dict:
    """Run each unexplained difference alone REPEATS times per runtime: {nodeid: {runtime: 'PPF'}}."""
    repeats = {}
    for diff in differences(per_runtime):
        if diff["category"] or is_xpass(diff) or "NR" in (diff["upstream"], diff["ours"]):
            continue
        nodeid = diff["nodeid"]
        repeats[nodeid] = {rt: "".join(run_alone(work, test_file, nodeid, rt, pytest_dir, f"repeat{i}")[0]
                                       for i in range(REPEATS)) for rt in RUNTIMES}
    return repeats


def results_from_junit(work: Path, test_file: str, nodeids, run: dict) -> dict:
    """A stored file run's per-test outcomes, read back from its junit XML (for --resume of a run recorded
    before the steps of [Note: a test run alone]); a test missing there did not report."""
    per_runtime = {}
    for rt in RUNTIMES:
        results = read_junit(work / "junit" / f"{file_stem(test_file)}.{rt}.xml", nodeids)
        why = (run.get("not_run", {}).get(rt) or ["did not report"])[0]
        per_runtime[rt] = {n: results.get(n, ("NR", why)) for n in nodeids}
    return per_runtime


def check_file(work: Path, test_file: str, per_runtime: dict, pytest_dir) -> dict:
    """The two steps of [Note: a test run alone], in place on ``per_runtime``; what they ran."""
    alone = fill_not_reported(work, test_file, per_runtime, pytest_dir)
    return {"alone": alone, "repeats": repeat_differences(work, test_file, per_runtime, pytest_dir)}


# What upstream's DistributedTest prints when a test outlives DS_UNITTEST_TIMEOUT. pytest then ends its session,
# but its process often does not exit: a rank blocked in a collective keeps the multiprocessing pool from
# joining, and the file would wait out the whole --timeout.
HANGED_LINE = "Test hanged, exiting"
HANGED_GRACE_S = 20


def wait_unless_hanged(proc, log_path: Path, timeout: float, poll_s: float = 5.0):
    """The pytest's exit status; "hanged" once its log says a test hanged and it has not exited HANGED_GRACE_S
    later (time for its junit XML); "timeout" after ``timeout`` seconds."""
    deadline, offset, tail, hanged_at = time.monotonic() + timeout, 0, b"", None
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if hanged_at is None:
            with open(log_path, "rb") as log_file:
                log_file.seek(offset)
                chunk = log_file.read()
            offset += len(chunk)
            if HANGED_LINE.encode() in tail + chunk:
                hanged_at = now
            tail = (tail + chunk)[-len(HANGED_LINE):]
        if hanged_at is not None and now - hanged_at >= HANGED_GRACE_S:
            return "hanged"
        if now >= deadline:
            return "timeout"


def check_runtime(log_file: Path, runtime: str, pytest_dir) -> None:
    """Stop unless the pytest process ran the runtime and the pytest asked for (its header names both)."""
    lines = log_file.read_text().splitlines()
    served = [line.split(RUNTIME_LINE, 1)[1] for line in lines if RUNTIME_LINE in line]
    if not served:
        return  # pytest ended before its header (e.g. a usage error); the junit XML tells
    ran = [line.split(PYTEST_LINE, 1)[1].strip() for line in lines if PYTEST_LINE in line]
    if pytest_dir is not None and ran and f"pytest-{ran[0]}" != pytest_dir.name:
        sys.exit(f"{log_file}: asked for {pytest_dir.name}, but the tests ran under pytest {ran[0]}")
    ours = "deepspeed_zero3" in served[0]
    if ours != (runtime == "ours"):
        sys.exit(f"{log_file}: asked for the {runtime} runtime, but parameter_offload came from {served[0]}. "
                 f"Is the overlay installed (python -m deepspeed_zero3)?")


def counts(results: dict) -> dict:
    tally = {o: 0 for o in OUTCOMES}
    for outcome, _ in results.values():
        tally[outcome] += 1
    return tally


def on_purpose(nodeid: str, our_message: str, their_message: str = ""):
    for category, node_pattern, message_pattern, why in ON_PURPOSE:
        if re.search(node_pattern, nodeid) and (message_pattern is None or re.search(message_pattern, our_message)):
            return category, why
    for node_pattern, message_pattern, why in UPSTREAM_FAILS:
        if re.search(node_pattern, nodeid) and re.search(message_pattern, their_message):
            return "u", why
    return None


def new_release(upstream: dict, shims: list, pytest_version: str, today: str) -> dict:
    """An empty store for one full run ([Note: a release of the compat table])."""
    return {"release": {"ours": our_revision(), "upstream": upstream, "pytest": pytest_version, "shims": shims,
                        "started": today, "machine": machine_dtypes()},
            "files": {}}


# What a run measures of this repository: the runtime, and the shims applied to upstream's tests.
MEASURED_PATHS = ("src", "setup.py", "pyproject.toml", "tools/compat_shims.py")


def measured_unchanged_since(commit: str) -> bool:
    """Whether nothing a run measures differs between ``commit`` and the working tree."""
    return subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", commit, "--", *MEASURED_PATHS]).returncode == 0


def same_release(store: dict, fresh: dict, unchanged_since=measured_unchanged_since) -> bool:
    """Whether ``store`` is a stopped run that ``--resume`` may continue: same upstream tests, pytest and shims,
    and nothing it measures changed since its commit (commits of docs, tests or this script in between do not
    change what the remaining files would measure)."""
    old, new = store.get("release") or {}, fresh["release"]
    if not all(old.get(key) == new[key] for key in ("upstream", "pytest", "shims")):
        return False
    ours = old.get("ours") or {}
    return not ours.get("changed_files") and "commit" in ours and unchanged_since(ours["commit"])


def update_store(store: dict, collections: dict, ran: dict, today: str, checks=None) -> None:
    items = {r["nodeid"]: r for r in collections["upstream"]["items"]}
    by_file = {}
    for record in items.values():
        by_file.setdefault(file_of(record["nodeid"]), []).append(record)
    store["collected_on"] = today
    store["collect_errors"] = {rt: c["errors"] for rt, c in collections.items()}
    store["skipped_modules"] = {rt: c.get("skipped_modules", []) for rt, c in collections.items()}
    files = store.setdefault("files", {})
    for test_file, records in sorted(by_file.items()):
        entry = files.setdefault(test_file, {})
        entry["collected"] = len(records)
        entry["stage3"] = sum(r["stage3"] for r in records)
    for test_file, per_runtime in ran.items():
        checked = (checks or {}).get(test_file)
        files[test_file]["run"] = {
            "on": today,
            "tests": files[test_file]["stage3"],
            "counts": {rt: counts(res) for rt, res in per_runtime.items()},
            "not_run": {rt: sorted({why for outcome, why in res.values() if outcome == "NR"})
                        for rt, res in per_runtime.items()},
            "differences": differences(per_runtime, (checked or {}).get("repeats")),
        }
        if checked is not None:
            files[test_file]["run"]["checked"] = {"alone": checked["alone"], "repeats": sorted(checked["repeats"])}


def is_xpass(diff: dict) -> bool:
    """[Note: XPASS from the two runtimes] An xfail mark is the test's, the same under both runtimes, and pytest's
    junit XML reports a non-strict XPASS as a plain pass (a strict one fails). So a test upstream xfails that ours
    passes is an XPASS under ours: upstream marks it as its own open follow-up, and ours already does it. The
    table counts it as XP, not P, and the differences list it as such, not as a bug."""
    return diff["upstream"] == "XF" and diff["ours"] == "P"


def counts_shown(run: dict) -> dict:
    """The per-runtime counts of a file's run, with ours' XPASSes moved from P to XP ([Note: XPASS from the two
    runtimes])."""
    shown = {rt: dict(run["counts"][rt]) for rt in RUNTIMES}
    xpasses = sum(1 for diff in run.get("differences", []) if is_xpass(diff))
    if xpasses:
        shown["ours"]["P"] = shown["ours"].get("P", 0) - xpasses
        shown["ours"]["XP"] = shown["ours"].get("XP", 0) + xpasses
    return shown


def differences(per_runtime: dict, repeats=None) -> list:
    found = []
    upstream, ours = per_runtime["upstream"], per_runtime["ours"]
    for nodeid in sorted(set(upstream) | set(ours)):
        theirs, mine = upstream.get(nodeid, ("not run", "")), ours.get(nodeid, ("not run", ""))
        if theirs[0] != mine[0]:
            purpose = on_purpose(nodeid, mine[1], theirs[1] if theirs[0] == "F" and mine[0] == "P" else "")
            diff = {
                "nodeid": nodeid,
                "upstream": theirs[0],
                "ours": mine[0],
                "category": purpose[0] if purpose else None,
                "why": purpose[1] if purpose else None,
                "ours_error": mine[1][-600:] if mine[0] == "F" else "",
            }
            alone = (repeats or {}).get(nodeid)
            if alone is not None:
                diff["repeats"] = alone
                diff["at_random"] = at_random(theirs[0], mine[0], alone)
            found.append(classify(diff))
    return found


def outcomes_of(repeated: str) -> list:
    """The outcomes of a difference's runs alone, stored as one string ('PNRF': P, NR, F)."""
    return re.findall(r"NR|XF|XP|P|F|S", repeated)


def at_random(theirs: str, mine: str, alone: dict) -> bool:
    """Whether a difference is chance ([Note: a test run alone]): run alone, each runtime showed the other's
    file-run outcome at least once."""
    return mine in outcomes_of(alone["upstream"]) and theirs in outcomes_of(alone["ours"])


def classify(diff: dict) -> dict:
    """A stored difference without a category, given the one RANDOM_UNDER_BOTH names (these lists explain, they
    do not measure: ``--render-only`` applies the current ones to a stored run)."""
    if not diff.get("category") and not is_xpass(diff):
        random_why, not_run_why = (listed_why(table, diff["nodeid"]) for table in (RANDOM_UNDER_BOTH, NOT_RUN_ALONE))
        if random_why:
            diff["category"], diff["why"] = "r", random_why
        elif "NR" in (diff["upstream"], diff["ours"]) and not_run_why:
            # Not a difference of the runtimes: one of them never ran it (its file run stopped before it).
            diff["category"], diff["why"] = "n", not_run_why
    return diff


def unexplained(diff: dict) -> bool:
    return not diff["category"] and not is_xpass(diff) and not diff.get("at_random")


def fmt(tally) -> str:
    return " / ".join(str(tally.get(o, 0)) for o in OUTCOMES) if tally else ""


def render(store: dict) -> str:
    release = store["release"]
    up, ours, machine = release["upstream"], release["ours"], release["machine"]
    clean = "a clean tree" if not ours["changed_files"] else (
        "with uncommitted changes to " + ", ".join(f"`{f}`" for f in ours["changed_files"]))
    fp16 = ("yes" if machine["fp16"] else "no") + f" (DeepSpeed's CPU accelerator reports " \
        f"{', '.join(machine['accelerator_dtypes']) or 'nothing'}; CPU flags: " \
        f"{', '.join(machine['cpu_flags']) or 'none of avx512_fp16, amx_fp16, amx_bf16, avx512_bf16'})"
    lines = [
        "# Upstream DeepSpeed's ZeRO-3 unit tests: upstream runtime vs deepspeed-zero3",
        "",
        "Generated by `make compat UPSTREAM=<DeepSpeed checkout>` (`tools/upstream_compat.py`) from",
        "`docs/compat/upstream-unit-tests.json`; edit the script or its `ON_PURPOSE` list, not this file. Why each",
        "difference exists, and the CPU-only failures of both runtimes, are explained in",
        "[upstream-differences.md](upstream-differences.md).",
        "",
        "## This release",
        "",
        f"* One full run of deepspeed-zero3 commit `{ours['commit']}` ({clean}), started {release['started']};",
        "  no row is carried over from another run ([Note: a release of the compat table] in the script).",
        f"* Every file ran under pytest {release['pytest']}"
        + (f", with the CPU shims ({', '.join(release['shims'])})" if release["shims"] else ", without shims") + ".",
        f"* Upstream's tests: commit `{up['commit']}` (version.txt {up['version_txt']}), `tests/` copied into",
        "  `compat-out/tests`; the installed deepspeed is the one both runtimes run. Nothing of upstream's is stored",
        "  in this repository.",
        f"* This CPU's fp16 support: {fp16}.",
    ]
    rendered = release.get("rendered_by")
    if rendered and rendered["commit"] != ours["commit"]:
        lines.append(f"* This page was rendered again from that run's results by the script at commit "
                     f"`{rendered['commit']}`; " + ("nothing under `src/`, `setup.py` or `pyproject.toml` changed "
                                                    "since the run's commit." if rendered["runtime_unchanged"] else
                                                    "**the runtime changed since the run's commit**."))
    lines += [
        "",
        "## How it runs",
        "",
        f"* Directories: {', '.join(f'`tests/{d}`' for d in up.get('dirs', FORMER_TEST_DIRS))}. `tests/pytest.ini` "
        "applies its default",
        "  `-m \"not sequential and not nightly ...\"`.",
        "* Stage-3 selection (`is_stage3` in the script): a `zero_stage`/`stage` parameter equal to 3; without one,",
        "  a stage-3 mark in the test's or its class's source (a stage-3 config, `zero.Init`, ZeRO-3 parameter",
        "  status, ...); without one either, a module named for ZeRO-3, or one with a stage-3 mark in a file whose",
        "  tests have no stage parameter at all. The rule errs towards running more: a test that never reaches",
        "  ZeRO-3 runs the same with both runtimes. The reason per test is in `compat-out/collect.upstream.json`.",
        "* Runtimes: `DEEPSPEED_ZERO3=0` (upstream untouched) and `=1` (ours), each file in its own pytest process,",
        "  one at a time, with `DS_ACCELERATOR=cpu LOCAL_SIZE=4 DS_UNITTEST_TIMEOUT=300` (gloo).",
        f"* pytest {UPSTREAM_PYTEST} (`--pytest`) is the newest upstream's requirements-dev.txt allows (`<8.4`): from",
        "  8.4 on, pytest ignores how upstream's `DistributedFixture` declares a fixture, and every test taking one",
        "  errors *fixture not found* under both runtimes.",
        "* CPU shims (`tools/compat_shims.py`, on unless `--no-shims`): two helpers of upstream's suite fail on",
        "  the CPU accelerator under both runtimes before DeepSpeed runs: DDP baselines built with",
        "  `device_ids=[rank]` (a string on CPU) and `unit.common.reduce_boolean_flags` (tensors on device `'0'`,",
        "  a 0-d all-gather gloo refuses). The scratch copy's `unit/common.py` gets one appended line that, on",
        "  CPU only, leaves DDP's `device_ids` unset for CPU modules and replaces that helper; no test body or",
        "  assertion changes.",
        "* Counts are passed / failed / skipped / xfailed / xpassed / not run (a test that did not report: its",
        "  pytest crashed or timed out; the reason is listed under the table). XPASS: a test upstream marks xfail",
        "  that passes ([Note: XPASS from the two runtimes] in the script).",
    ]
    if any("checked" in (entry.get("run") or {}) for entry in store["files"].values()):
        lines += [
            "* Then, per file, each test in its own pytest process ([Note: a test run alone] in the script): a test",
            "  that did not report is run alone once, and its outcome counts; a difference not on purpose is run",
            f"  alone {REPEATS} times under each runtime, and is listed as failing at random under both when each",
            "  runtime shows the other's outcome at least once.",
        ]
    lines += [
        "",
        "## Results",
        "",
        "| file | collected | stage-3 | run | upstream P/F/S/XF/XP/NR | deepspeed-zero3 P/F/S/XF/XP/NR |",
        "|---|---|---|---|---|---|",
    ]
    totals = {rt: {o: 0 for o in OUTCOMES} for rt in RUNTIMES}
    total_run = 0
    not_run_notes = []
    for test_file, entry in sorted(store["files"].items()):
        run = entry.get("run")
        if run is None:
            if entry.get("stage3", 0) == 0:
                continue
            cells = ["not run in this release", "", ""]
        else:
            shown = counts_shown(run)
            for rt in RUNTIMES:
                for o in OUTCOMES:
                    totals[rt][o] += shown[rt].get(o, 0)
            total_run += run["tests"]
            mine = fmt(shown["ours"])
            if shown["ours"].get("F", 0) > shown["upstream"].get("F", 0):
                mine = mine.replace(f"/ {shown['ours']['F']} /", f"/ **{shown['ours']['F']}** /", 1)
            cells = [str(run["tests"]), fmt(shown["upstream"]), mine]
            for rt, reasons in sorted(run.get("not_run", {}).items()):
                not_run_notes += [f"* `{test_file.removeprefix('unit/')}` under {rt}: {why}" for why in reasons]
        lines.append(f"| {test_file.removeprefix('unit/')} | {entry.get('collected', '')} | {entry.get('stage3', '')} "
                     f"| {' | '.join(cells)} |")
    lines.append(f"| **total run** | | | **{total_run}** | **{fmt(totals['upstream'])}** | **{fmt(totals['ours'])}** |")
    lines += ["", f"Stage-3 tests selected: {sum(e.get('stage3', 0) for e in store['files'].values())}; run in this "
              f"release: {total_run}."]
    if not_run_notes:
        lines += ["", "Tests that did not report:", ""] + not_run_notes
    alone_notes = [f"* `{test_file.removeprefix('unit/')}` under {rt}: {len(nodeids)}"
                   for test_file, entry in sorted(store["files"].items())
                   for rt, nodeids in sorted(((entry.get("run") or {}).get("checked") or {}).get("alone", {}).items())]
    if alone_notes:
        lines += ["", "Tests that did not report in their file's run and were run alone, once each (their outcome is",
                  "in the counts; [Note: a test run alone] in the script):", ""] + alone_notes
    lines += ["", f"Collected on {store.get('collected_on', '?')} under both runtimes. Collection errors: "
              + "; ".join(f"{rt}: {len(errs)}" for rt, errs in sorted(store.get("collect_errors", {}).items())) + "."]
    for rt, errs in sorted(store.get("collect_errors", {}).items()):
        for err in sorted(errs, key=lambda e: e["nodeid"]):
            lines.append(f"* {rt}: `{err['nodeid']}`: `{err['error'].strip().splitlines()[-1][:200]}`")
    skipped = (store.get("skipped_modules") or {}).get("upstream", [])
    lines += ["", "## Not applicable on this machine", ""]
    if skipped:
        lines += ["Modules that skip themselves at collection here (under both runtimes alike); their tests are not",
                  "in the counts:", ""]
        lines += [f"* `{m['nodeid'].removeprefix('unit/')}`: {m['reason']}" for m in sorted(skipped, key=lambda m: m["nodeid"])]
    else:
        lines.append("No module of these directories skips itself at collection on this machine.")
    lines += ["", "## Tests whose outcome differs between the runtimes", ""]
    any_difference = False
    for test_file, entry in sorted(store["files"].items()):
        for diff in (entry.get("run") or {}).get("differences", []):
            any_difference = True
            if is_xpass(diff):
                label = "XPASS under ours: upstream marks it xfail, as its own open follow-up"
            elif diff["category"] == "u":
                label = f"upstream's own failure on this CPU, category (u): {diff['why']}"
            elif diff["category"] == "r":
                label = f"fails at random under both runtimes, category (r): {diff['why']}"
            elif diff["category"] == "n":
                label = f"not measured under one runtime, category (n): not run alone, as {diff['why']}"
            elif diff["category"]:
                label = f"on purpose, category ({diff['category']}): {diff['why']}"
            elif diff.get("at_random"):
                label = "fails at random under both runtimes"
            elif diff["upstream"] == "F" and diff["ours"] == "P":
                label = "**upstream fails and ours passes: to explain**"
            else:
                label = "**not on purpose: a bug to fix**"
            if "repeats" in diff:
                up, mine = (outcomes_of(diff["repeats"][rt]) for rt in ("upstream", "ours"))
                label += f" (run alone {len(up)} times: upstream {'/'.join(up)}, ours {'/'.join(mine)})"
            lines.append(f"* `{diff['nodeid'].removeprefix('unit/')}`: upstream {diff['upstream']}, ours "
                         f"{'XP' if is_xpass(diff) else diff['ours']}; {label}")
    if not any_difference:
        lines.append("None.")
    lines += [
        "",
        "Categories: (b) the test asserts upstream internals our design changes on purpose; (d) the test expects",
        "upstream's failure where ours trains, bitwise equal to upstream trained the supported way.",
    ]
    used = {d["category"] for e in store["files"].values() for d in (e.get("run") or {}).get("differences", [])}
    if "u" in used:
        lines += ["(u) upstream fails the test with an error of its own runtime code on this CPU, which a later",
                  "release fixed, and ours passes."]
    if "n" in used:
        lines += ["(n) one runtime's file run stopped before the test, and the test is not run alone here",
                  "(`NOT_RUN_ALONE` in the script): the outcomes are not a difference of the runtimes."]
    if "r" in used:
        lines += ["(r) the test fails at random under both runtimes here, measured by hand (the why gives the runs);",
                  "one file run's outcomes differ by chance."]
    lines += [""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, help="a DeepSpeed source checkout (its tests/)")
    parser.add_argument("--work", type=Path, default=REPO / "compat-out", help="scratch directory")
    parser.add_argument("--files", nargs="*", default=None,
                        help="run only test files whose path ends with one of these: a partial run, whose table "
                        "goes to <work>/partial-unit-tests.md, never the docs")
    parser.add_argument("--collect-only", action="store_true", help="collect and count only, into <work>")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from the results store only")
    parser.add_argument("--resume", action="store_true",
                        help="continue a stopped full run of the same upstream tests, pytest and shims, while nothing "
                        "it measures (src/, setup.py, pyproject.toml, the shims) changed since its commit: files it "
                        "holds are not run again")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per file and runtime (a file of 70 "
                        "distributed tests takes about 25 minutes on 2 cores)")
    parser.add_argument("--pytest", default=UPSTREAM_PYTEST, help="pytest version the tests run under, installed "
                        "into the work directory, or 'installed' for this venv's (default: %(default)s, the newest "
                        "upstream's requirements-dev.txt allows)")
    parser.add_argument("--no-shims", action="store_true", help="run upstream's tests exactly as fetched, without "
                        "the CPU shims for two of their helpers (tools/compat_shims.py)")
    parser.add_argument("--results", type=Path, default=None,
                        help="results store (default docs/compat/upstream-unit-tests.json; <work>/partial-unit-tests.json "
                        "for --files and --collect-only)")
    parser.add_argument("--doc", type=Path, default=None, help="the rendered table (default: next to the results)")
    args = parser.parse_args(argv)

    partial = args.files is not None or args.collect_only
    if args.results is None:
        args.results = (args.work / "partial-unit-tests.json") if partial else REPO / "docs/compat/upstream-unit-tests.json"
    if args.doc is None:
        args.doc = args.results.with_suffix(".md")
    if not args.render_only and args.upstream is None:
        parser.error("--upstream is required (a DeepSpeed source checkout)")
    if args.render_only:
        store = json.loads(args.results.read_text())
        for entry in store["files"].values():
            for diff in (entry.get("run") or {}).get("differences", []):
                classify(diff)
        run_commit = store["release"]["ours"]["commit"]
        diff = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", run_commit, "HEAD", "--", "src", "setup.py",
                               "pyproject.toml"])
        store["release"]["rendered_by"] = {"commit": our_revision()["commit"], "runtime_unchanged": diff.returncode == 0}
        args.results.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
        args.doc.write_text(render(store))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    upstream = prepare(args.upstream.resolve(), args.work, shims=not args.no_shims)
    shims = [] if args.no_shims else list(compat_shims.NAMES)
    pytest_dir = install_pytest(args.work, args.pytest)
    pytest_version = args.pytest if pytest_dir else installed_pytest_version()
    today = datetime.date.today().isoformat()
    store = new_release(upstream, shims, pytest_version, today)
    if args.resume and args.results.exists():
        earlier = json.loads(args.results.read_text())
        if not same_release(earlier, store):
            sys.exit(f"--resume: {args.results} holds a run of other upstream tests, pytest or shims, or "
                     f"{', '.join(MEASURED_PATHS)} changed since its commit "
                     f"({(earlier.get('release') or {}).get('ours')}); start a full run without --resume")
        store = earlier
    if store["release"]["ours"]["changed_files"] and not partial:
        log(f"warning: measuring a tree with uncommitted changes to {store['release']['ours']['changed_files']}; "
            f"the page will say so")
    collections = {rt: collect(args.work, rt, args.timeout, pytest_dir) for rt in RUNTIMES}
    selected = {}
    for record in collections["upstream"]["items"]:
        if record["stage3"]:
            selected.setdefault(file_of(record["nodeid"]), []).append(record["nodeid"])
    log(f"{sum(map(len, selected.values()))} stage-3 tests in {len(selected)} files "
        f"(of {len(collections['upstream']['items'])} collected)")

    def save(ran, checks=None):
        update_store(store, collections, ran, today, checks)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
        args.doc.write_text(render(store))

    save({})
    if not args.collect_only:
        # Smallest files first and the store written after each one: a run cut short (the whole suite takes
        # hours on 2 cores) still leaves every finished file in the table, and --resume goes on from there.
        for test_file, nodeids in sorted(selected.items(), key=lambda kv: (len(kv[1]), kv[0])):
            if args.files is not None and not any(test_file.endswith(f) for f in args.files):
                continue
            stored = (store["files"].get(test_file) or {}).get("run")
            if args.resume and stored and "checked" in stored:
                continue
            wait_while_paused(args.work)
            if args.resume and stored:
                per_runtime = results_from_junit(args.work, test_file, nodeids, stored)
            else:
                per_runtime = {rt: run_file(args.work, test_file, nodeids, rt, args.timeout, pytest_dir)
                               for rt in RUNTIMES}
                save({test_file: per_runtime})  # the file run is kept even if the steps below are cut short
            save({test_file: per_runtime}, {test_file: check_file(args.work, test_file, per_runtime, pytest_dir)})
    log(f"wrote {args.results} and {args.doc}")
    left = [d for e in store["files"].values() for d in (e.get("run") or {}).get("differences", []) if unexplained(d)]
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
