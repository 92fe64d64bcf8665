"""Upstream DeepSpeed's own ZeRO-3 unit tests under both runtimes: ``make compat UPSTREAM=<checkout>``.

Copies ``<checkout>/tests`` into a scratch directory (``compat-out/`` by default, never into this repository:
we run upstream's tests, we do not ship them), selects the stage-3 tests of the directories in ``TEST_DIRS``,
runs each file under upstream (``DEEPSPEED_ZERO3=0``) and under ours (``DEEPSPEED_ZERO3=1``), one pytest
process per file and runtime, one at a time, and rebuilds ``docs/compat/upstream-unit-tests.md`` from the
results, which it keeps in ``docs/compat/upstream-unit-tests.json``. Files not run this time keep the rows
measured before, each row dated, so a partial run (``--files``) updates only its own rows.

Only ``tests/`` is copied: upstream's ``tests/conftest.py`` puts the directory above it on ``sys.path``, and
a checkout's ``deepspeed/`` there would shadow the installed deepspeed that both runtimes must share.

The same file is the pytest plugin (``-p upstream_compat``) that classifies and selects the tests inside
those pytest processes; see ``is_stage3`` for the rule.

Usage (from the repository root; the whole suite takes about an hour per runtime on 2 cores):

    python tools/upstream_compat.py --upstream /work/upstream-ds                  # everything
    python tools/upstream_compat.py --upstream /work/upstream-ds --collect-only   # counts only
    python tools/upstream_compat.py --upstream /work/upstream-ds --files test_z3_eager_fallback.py
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
from pathlib import Path

import compat_shims  # stdlib only at import, as the plugin needs
from deepspeed_zero3.testing.ports import shm_buffers  # stdlib only: cheap in the driver and in the plugin

REPO = Path(__file__).resolve().parent.parent
TEST_DIRS = ("unit/v1/zero", "unit/runtime/zero", "unit/v1/compile", "unit/checkpoint")
RUNTIMES = {"upstream": "0", "ours": "1"}
TIMEOUT_GRACE_S = 120
ENV = {"DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "4", "DS_UNITTEST_TIMEOUT": "300"}
SELECT_ENV = "ZERO3_COMPAT_SELECT"
COLLECT_ENV = "ZERO3_COMPAT_COLLECT"
OUTCOMES = ("P", "F", "S", "XF")
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
]

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
_marker_deselected = []


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append({"nodeid": report.nodeid, "error": str(report.longrepr)[-1500:]})


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
        "path": str(upstream),
        "commit": upstream_revision(upstream),
        "version_txt": version.read_text().strip() if version.exists() else "unknown",
    }


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
    env = dict(os.environ, **ENV, DEEPSPEED_ZERO3=RUNTIMES[runtime], **extra)
    paths = (str(REPO / "tools"), str(pytest_dir) if pytest_dir else None, env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def collect(work: Path, runtime: str, timeout: int, pytest_dir) -> dict:
    out = work / f"collect.{runtime}.json"
    out.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "upstream_compat", "--collect-only",
               "-q"] + [f"tests/{d}" for d in TEST_DIRS]
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


def run_file(work: Path, test_file: str, nodeids, runtime: str, timeout: int, pytest_dir) -> dict:
    stem = test_file.replace("/", "_")[:-3]
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
    log(f"{test_file}: {len(nodeids)} tests under {runtime}")
    (work / "logs").mkdir(exist_ok=True)
    shm_before = set(shm_buffers())
    with open(work / "logs" / f"{stem}.{runtime}.log", "w") as output:
        proc = subprocess.Popen(command, cwd=work, env=child_env(runtime, pytest_dir, **{SELECT_ENV: str(select)}),
                                stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # SIGINT first: pytest stops, reports and writes the junit XML of the tests it finished, so a file
            # that overran keeps those; whatever is left of its process group is killed after a grace period.
            rc = "timeout"
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
    log(f"{test_file} under {runtime}: rc {rc}, {counts(results)}")
    return results


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


def on_purpose(nodeid: str, our_message: str):
    for category, node_pattern, message_pattern, why in ON_PURPOSE:
        if re.search(node_pattern, nodeid) and (message_pattern is None or re.search(message_pattern, our_message)):
            return category, why
    return None


def update_store(store: dict, collections: dict, ran: dict, upstream: dict, today: str, shims: list,
                 pytest_version: str) -> None:
    items = {r["nodeid"]: r for r in collections["upstream"]["items"]}
    by_file = {}
    for record in items.values():
        by_file.setdefault(file_of(record["nodeid"]), []).append(record)
    store["upstream"] = upstream
    store["collected_on"] = today
    store["collect_errors"] = {rt: c["errors"] for rt, c in collections.items()}
    files = store.setdefault("files", {})
    for test_file, records in sorted(by_file.items()):
        entry = files.setdefault(test_file, {})
        entry["collected"] = len(records)
        entry["stage3"] = sum(r["stage3"] for r in records)
        entry["collected_on"] = today
    for test_file, per_runtime in ran.items():
        entry = files[test_file]
        entry["run"] = {
            "on": today,
            "source": "make compat",
            "tests": entry["stage3"],
            "scope": "every stage-3 test",
            "counts": {rt: counts(res) for rt, res in per_runtime.items()},
            "differences": differences(per_runtime),
            "shims": shims,
            "pytest": pytest_version,
        }


def differences(per_runtime: dict) -> list:
    found = []
    upstream, ours = per_runtime["upstream"], per_runtime["ours"]
    for nodeid in sorted(set(upstream) | set(ours)):
        theirs, mine = upstream.get(nodeid, ("not run", "")), ours.get(nodeid, ("not run", ""))
        if theirs[0] != mine[0]:
            purpose = on_purpose(nodeid, mine[1])
            found.append({
                "nodeid": nodeid,
                "upstream": theirs[0],
                "ours": mine[0],
                "category": purpose[0] if purpose else None,
                "why": purpose[1] if purpose else None,
                "ours_error": mine[1][-600:] if mine[0] == "F" else "",
            })
    return found


def fmt(tally) -> str:
    return " / ".join(str(tally.get(o, 0)) for o in OUTCOMES) if tally else ""


def render(store: dict) -> str:
    up = store["upstream"]
    lines = [
        "# Upstream DeepSpeed's ZeRO-3 unit tests: upstream runtime vs deepspeed-zero3",
        "",
        "Generated by `make compat UPSTREAM=<DeepSpeed checkout>` (`tools/upstream_compat.py`) from",
        "`docs/compat/upstream-unit-tests.json`; edit the script or its `ON_PURPOSE` list, not this file. Why each",
        "on-purpose difference exists, and the CPU-only failures of both runtimes, are explained in",
        "[upstream-differences.md](upstream-differences.md).",
        "",
        "## How it runs",
        "",
        f"* Tests: `tests/` of the upstream checkout `{up['path']}` (commit `{up['commit']}`, version.txt",
        f"  {up['version_txt']}), copied into `compat-out/tests`; only `tests/` is copied, so the installed",
        "  deepspeed is the one both runtimes run. Nothing of upstream's is stored in this repository.",
        f"* Directories: {', '.join(f'`tests/{d}`' for d in TEST_DIRS)}. `tests/pytest.ini` applies its default",
        "  `-m \"not sequential and not nightly ...\"`.",
        "* Stage-3 selection (`is_stage3` in the script): a `zero_stage`/`stage` parameter equal to 3; without one,",
        "  a stage-3 mark in the test's or its class's source (a stage-3 config, `zero.Init`, ZeRO-3 parameter",
        "  status, ...); without one either, a module named for ZeRO-3, or one with a stage-3 mark in a file whose",
        "  tests have no stage parameter at all. The rule errs towards running more: a test that never reaches",
        "  ZeRO-3 runs the same with both runtimes. The reason per test is in `compat-out/collect.upstream.json`.",
        "* Runtimes: `DEEPSPEED_ZERO3=0` (upstream untouched) and `=1` (ours), each file in its own pytest process,",
        "  one at a time, with `DS_ACCELERATOR=cpu LOCAL_SIZE=4 DS_UNITTEST_TIMEOUT=300` (gloo).",
        f"* pytest: the children run pytest {UPSTREAM_PYTEST} (`--pytest`), the newest upstream's requirements-dev.txt",
        "  allows (`<8.4`): from 8.4 on, pytest ignores how upstream's `DistributedFixture` declares a fixture and",
        "  every test taking one errors *fixture not found* under both runtimes. Each row names the pytest it ran",
        "  under; in upstream's 0.19.6 snapshot only `test_universal_checkpoint.py` and `test_zero_optimizer.py` take",
        "  a `DistributedFixture`.",
        "* CPU shims (`tools/compat_shims.py`, on unless `--no-shims`): two helpers of upstream's suite fail on",
        "  the CPU accelerator under both runtimes before DeepSpeed runs: DDP baselines built with",
        "  `device_ids=[rank]` (a string on CPU) and `unit.common.reduce_boolean_flags` (tensors on device `'0'`,",
        "  a 0-d all-gather gloo refuses). The scratch copy's `unit/common.py` gets one appended line that, on",
        "  CPU only, leaves DDP's `device_ids` unset for CPU modules and replaces that helper; no test body or",
        "  assertion changes. Rows run with them say *CPU shims*; rows without were run on unmodified tests.",
        "* Counts are passed / failed / skipped / xfailed. A row's *run on* date says when it was measured; rows",
        "  marked *earlier table* come from the first, hand-run measurement (same upstream commit, subsets of",
        "  some files) and have not been re-run by the script yet.",
        "",
        "## Results",
        "",
        "| file | collected | stage-3 | run | upstream P/F/S/XF | deepspeed-zero3 P/F/S/XF | run on |",
        "|---|---|---|---|---|---|---|",
    ]
    totals = {rt: {o: 0 for o in OUTCOMES} for rt in RUNTIMES}
    total_run = 0
    for test_file, entry in sorted(store["files"].items()):
        run = entry.get("run")
        if run is None:
            if entry.get("stage3", 0) == 0:
                continue
            cells = ["not run yet", "", "", ""]
        else:
            for rt in RUNTIMES:
                for o in OUTCOMES:
                    totals[rt][o] += run["counts"][rt].get(o, 0)
            total_run += run["tests"]
            ours = fmt(run["counts"]["ours"])
            if run["counts"]["ours"].get("F", 0) > run["counts"]["upstream"].get("F", 0):
                ours = ours.replace(f"/ {run['counts']['ours']['F']} /", f"/ **{run['counts']['ours']['F']}** /", 1)
            scope = f"{run['tests']}" + ("" if run["scope"] == "every stage-3 test" else f" ({run['scope']})")
            when = run["on"] + ("" if run["source"] == "make compat" else f", {run['source']}")
            when += f", pytest {run['pytest']}" + (", CPU shims" if run.get("shims") else "")
            cells = [scope, fmt(run["counts"]["upstream"]), ours, when]
        lines.append(f"| {test_file.removeprefix('unit/')} | {entry.get('collected', '')} | {entry.get('stage3', '')} "
                     f"| {' | '.join(cells)} |")
    lines.append(f"| **total run** | | | **{total_run}** | **{fmt(totals['upstream'])}** | **{fmt(totals['ours'])}** | |")
    runs = [e["run"] for e in store["files"].values() if e.get("run")]
    by_source = {}
    for run in runs:
        label = f"run by `make compat` on {run['on']}" if run["source"] == "make compat" else f"from the {run['source']}"
        by_source[label] = by_source.get(label, 0) + run["tests"]
    lines += [
        "",
        f"Stage-3 tests selected: {sum(e.get('stage3', 0) for e in store['files'].values())}. Run: {total_run}, "
        + ", ".join(f"{n} {label}" for label, n in sorted(by_source.items())) + ". Rows *not run yet* wait for a "
        "full `make compat`.",
        "",
        f"Collected on {store['collected_on']} under both runtimes. Collection errors: "
        + "; ".join(f"{rt}: {len(errs)}" for rt, errs in sorted(store.get("collect_errors", {}).items())) + ".",
    ]
    for rt, errs in sorted(store.get("collect_errors", {}).items()):
        for err in errs:
            lines.append(f"* {rt}: `{err['nodeid']}`: `{err['error'].strip().splitlines()[-1][:200]}`")
    lines += ["", "## Tests whose outcome differs between the runtimes", ""]
    any_difference = False
    for test_file, entry in sorted(store["files"].items()):
        for diff in (entry.get("run") or {}).get("differences", []):
            any_difference = True
            label = (f"on purpose, category ({diff['category']}): {diff['why']}" if diff["category"] else
                     "**not on purpose: a bug to fix**")
            lines.append(f"* `{diff['nodeid'].removeprefix('unit/')}`: upstream {diff['upstream']}, ours "
                         f"{diff['ours']}; {label}")
    if not any_difference:
        lines.append("None.")
    lines += [
        "",
        "Categories: (b) the test asserts upstream internals our design changes on purpose; (c) a feature we",
        "refuse with `NotImplementedError`, naming the kill switch.",
        "",
    ]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, help="a DeepSpeed source checkout (its tests/)")
    parser.add_argument("--work", type=Path, default=REPO / "compat-out", help="scratch directory")
    parser.add_argument("--files", nargs="*", default=None,
                        help="run only test files whose path ends with one of these (default: every file with "
                        "stage-3 tests); other rows keep their earlier measurement")
    parser.add_argument("--collect-only", action="store_true", help="update the collected/stage-3 counts only")
    parser.add_argument("--render-only", action="store_true", help="rebuild the table from the results store only")
    parser.add_argument("--resume", action="store_true",
                        help="skip files the results store already holds a `make compat` run of from today, "
                        "under the same pytest and shims (to continue a run that was stopped)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per file and runtime (a file of 70 "
                        "distributed tests takes about 25 minutes on 2 cores)")
    parser.add_argument("--pytest", default=UPSTREAM_PYTEST, help="pytest version the tests run under, installed "
                        "into the work directory, or 'installed' for this venv's (default: %(default)s, the newest "
                        "upstream's requirements-dev.txt allows)")
    parser.add_argument("--no-shims", action="store_true", help="run upstream's tests exactly as fetched, without "
                        "the CPU shims for two of their helpers (tools/compat_shims.py)")
    parser.add_argument("--results", type=Path, default=REPO / "docs/compat/upstream-unit-tests.json")
    parser.add_argument("--doc", type=Path, default=REPO / "docs/compat/upstream-unit-tests.md")
    args = parser.parse_args(argv)

    if not args.render_only and args.upstream is None:
        parser.error("--upstream is required (a DeepSpeed source checkout)")
    if args.render_only:
        args.doc.write_text(render(json.loads(args.results.read_text())))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    upstream = prepare(args.upstream.resolve(), args.work, shims=not args.no_shims)
    shims = [] if args.no_shims else list(compat_shims.NAMES)
    pytest_dir = install_pytest(args.work, args.pytest)
    pytest_version = args.pytest if pytest_dir else installed_pytest_version()
    today = datetime.date.today().isoformat()
    collections = {rt: collect(args.work, rt, args.timeout, pytest_dir) for rt in RUNTIMES}
    selected = {}
    for record in collections["upstream"]["items"]:
        if record["stage3"]:
            selected.setdefault(file_of(record["nodeid"]), []).append(record["nodeid"])
    log(f"{sum(map(len, selected.values()))} stage-3 tests in {len(selected)} files "
        f"(of {len(collections['upstream']['items'])} collected)")

    store = json.loads(args.results.read_text()) if args.results.exists() else {}

    def save(ran):
        update_store(store, collections, ran, upstream, today, shims, pytest_version)
        args.results.write_text(json.dumps(store, indent=1, sort_keys=True) + "\n")
        args.doc.write_text(render(store))

    save({})
    if not args.collect_only:
        # Smallest files first and the store written after each one: a run cut short (the whole suite takes
        # hours on 2 cores) still leaves every finished file in the table.
        for test_file, nodeids in sorted(selected.items(), key=lambda kv: (len(kv[1]), kv[0])):
            if args.files is not None and not any(test_file.endswith(f) for f in args.files):
                continue
            earlier = (store.get("files", {}).get(test_file) or {}).get("run") or {}
            if args.resume and (earlier.get("on"), earlier.get("pytest"), earlier.get("shims")) == (
                    today, pytest_version, shims):
                continue
            wait_while_paused(args.work)
            save({test_file: {rt: run_file(args.work, test_file, nodeids, rt, args.timeout, pytest_dir)
                              for rt in RUNTIMES}})
    log(f"wrote {args.results.relative_to(REPO)} and {args.doc.relative_to(REPO)}")
    unexplained = [d for e in store["files"].values() for d in (e.get("run") or {}).get("differences", [])
                   if not d["category"]]
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
