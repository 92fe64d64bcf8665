"""Write docs/compat/versions.md from what `make test-versions` left in its results folder.

    python scripts/versions_table.py RESULTS_DIR OUTPUT_MD

RESULTS_DIR holds one folder per deepspeed release, one per torch release (``torch-<version>``) and one per Python
(``python-<version>``), each with
``<suite>.log`` (the suite's whole output), ``<suite>.rc`` (its exit status), ``<suite>.seconds`` and
``<suite>.measured`` (the commit it started on and the day; results written before there was one per suite
have a folder-wide ``measured.txt``) and ``installed.txt`` (the venv's python, torch and deepspeed). Counts are read from pytest's closing lines ("3 passed, 1 skipped in 2.1s"); a distributed suite
prints one per rank, and the table shows rank 0's with a note when the ranks disagree.

A release without a results folder keeps its row from OUTPUT_MD as it was, with the commit and day it was
measured on, so rerunning one release rewrites that row only; a supported release or a torch of the Makefile's
matrix that has neither is listed as not run, so the tables never hide one. Standard library only: it runs with
any python.
"""

import datetime
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _tables():
    # Loaded from its file: the python running this script need not have the package installed.
    path = REPO / "src" / "deepspeed_zero3" / "bench" / "tables.py"
    spec = importlib.util.spec_from_file_location("tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

SUITES = ("unit", "distributed", "parity", "parity-smoke", "counts")
# A release run with the whole suites ran the smoke's scenarios and the exact counts inside them.
_INSIDE = {"parity-smoke": "parity", "counts": "distributed"}
TORCH_SUITES = ("unit", "parity-torch", "counts-torch")
PYTHON_SUITES = ("unit", "parity-smoke")
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_SUMMARY = re.compile(r"((?:\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)"
                      r"(?:, )?)+) in [\d.]+s")
_COUNT = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed)")
# The distributed harness ends a rank at its first failure, before pytest's closing line; it names the test.
_FAILED = re.compile(r"^(?:\[rank \d+\] )?FAILED (\S+)")


def supported_versions(repo: Path):
    text = (repo / "src" / "deepspeed_zero3" / "_compat.py").read_text()
    line = next(line for line in text.splitlines() if line.startswith("SUPPORTED_DEEPSPEED_VERSIONS = "))
    return re.findall(r'"([^"]+)"', line)


def makefile_list(repo: Path, name: str):
    """A variable's words as the Makefile first assigns it (``NAME := ...`` or ``NAME ?= ...``)."""
    text = (repo / "Makefile").read_text()
    for line in text.splitlines():
        match = re.match(rf"^{name} [:?]= (.*)$", line)
        if match:
            return match.group(1).split()
    raise SystemExit(f"versions_table: the Makefile has no {name}")


def torch_versions(repo: Path):
    """The Makefile's TORCH_VERSIONS: the torch matrix."""
    return makefile_list(repo, "TORCH_VERSIONS")


def python_versions(repo: Path):
    """The Makefile's PYTHON_VERSIONS: the Python matrix."""
    return makefile_list(repo, "PYTHON_VERSIONS")


# The clients' rows: (results folder, suite, what runs), on the release the Makefile names for their users.
CLIENT_ROWS = (("lightning", "LIGHTNING_DEEPSPEED_VERSION", "Lightning's flows (tests/integration/test_lightning.py)"),
               ("hf", "HF_DEEPSPEED_VERSION", "the Hugging Face Trainer, TRL and peft flows "
                "(tests/integration/test_hf.py, test_clients.py)"))


def client_rows(repo: Path):
    return [(f"{client}-{makefile_list(repo, variable)[0]}", f"integration-{client}", what)
            for client, variable, what in CLIENT_ROWS]


def summaries(log_text: str):
    """Counts of every pytest closing line in a log, in order (one per rank for the distributed suite)."""
    found = []
    # Searched, not matched per line: the ranks' closing lines can land on one line of the log.
    for match in _SUMMARY.finditer(log_text):
        counts = dict.fromkeys(OUTCOMES, 0)
        for number, outcome in _COUNT.findall(match.group(1)):
            counts["error" if outcome.startswith("error") else outcome] += int(number)
        found.append(counts)
    return found


def read_suite(folder: Path, suite: str):
    """None when the suite did not run for this release; else rc, seconds, counts and any disagreement."""
    log, rc = folder / f"{suite}.log", folder / f"{suite}.rc"
    if not log.exists() or not rc.exists():
        return None
    seconds = folder / f"{suite}.seconds"
    text = log.read_text(errors="replace")
    found = summaries(text)
    return {
        "failed_tests": sorted({m.group(1) for m in map(_FAILED.match, text.splitlines()) if m}),
        "rc": int(rc.read_text().strip() or -1),
        "seconds": int(seconds.read_text().strip()) if seconds.exists() else None,
        "counts": found[0] if found else None,
        "ranks": len(found),
        "ranks_agree": all(counts == found[0] for counts in found),
    }


def cell(result) -> str:
    if result is None:
        return "not run"
    counts = result["counts"]
    if counts is None:
        if result["failed_tests"]:
            return (f"FAIL: stopped at its first failure (exit {result['rc']}): "
                    + ", ".join(f"`{name}`" for name in result["failed_tests"]))
        return f"no pytest summary (exit {result['rc']})"
    parts = [f"{counts['passed']} passed", f"{counts['failed'] + counts['error']} failed"]
    parts += [f"{counts[k]} {k}" for k in ("skipped", "xfailed", "xpassed") if counts[k]]
    green = result["rc"] == 0 and counts["failed"] == counts["error"] == 0
    text = ("ok: " if green else "FAIL: ") + ", ".join(parts)
    if result["ranks"] > 1:
        text += f" (each of {result['ranks']} ranks)" if result["ranks_agree"] else " (ranks disagree: rank 0 shown)"
    if result["seconds"] is not None:
        text += f"; {result['seconds']} s"
    return text


def _text(path: Path):
    return path.read_text().strip() if path.exists() and path.read_text().strip() else None


def installed(folder: Path) -> str:
    text = _text(folder / "installed.txt")
    return text.splitlines()[-1] if text else "not run"


def measured(folder: Path, suites) -> str:
    """The commit and day the row's suites ran on; one value when they agree, else each suite's."""
    per_suite = {suite: _text(folder / f"{suite}.measured") for suite in suites}
    per_suite = {suite: value for suite, value in per_suite.items() if value}
    if not per_suite:
        return _text(folder / "measured.txt") or "not recorded"
    if len(set(per_suite.values())) == 1:
        return next(iter(per_suite.values()))
    return "; ".join(f"{suite}: {value}" for suite, value in per_suite.items())


def previous_rows(text: str):
    """The rows of an earlier page, by section and first cell. A table written before the page had its
    ``measured`` column gets one: the day of that page, its commit not recorded."""
    rows = {"deepspeed": {}, "torch": {}, "python": {}, "client": {}}
    written = re.search(r"Last written: (\d{4}-\d{2}-\d{2})", text)
    section, has_measured, header = None, True, False
    headings = {"## deepspeed releases": "deepspeed", "## torch releases": "torch", "## Python versions": "python",
                "## Client libraries": "client"}
    for line in text.splitlines():
        heading = next((name for start, name in headings.items() if line.startswith(start)), None)
        if line.startswith("## "):  # another heading ends the section ("What a pass costs" has a table too)
            section, header = heading, heading is not None
        elif section and header and line.startswith("| "):  # the table's first line (the clients' says "row")
            has_measured, header = "| measured |" in line, False
        elif section and line.startswith("| ") and not line.startswith("| ---"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            if not has_measured:
                cells.insert(1, f"commit not recorded, {written.group(1) if written else 'day unknown'}")
            rows[section][cells[0]] = cells
    return rows


_COMMIT = re.compile(r"\b[0-9a-f]{12}\b")


def older_rows(rows, runtime, required):
    """The names of ``rows`` not measured in full on the runtime that ships: a row is current when every commit its
    ``measured`` cell names descends from ``runtime``'s last change (``(commit, descends(commit))``) and each cell
    ``required(row)`` indexes passed (``ok: ...``, or ``in <suite>`` for a suite run inside another)."""
    if runtime is None:
        return []
    _, descends = runtime
    older = []
    for row in rows:
        name, measured_cell = row[0], row[1]
        commits = _COMMIT.findall(measured_cell)
        passed = all(row[i].startswith(("ok: ", "in ")) for i in required(row))
        if not commits or not all(descends(commit) for commit in commits) or not passed:
            older.append(name)
    return older


def staleness_line(rows, runtime, required):
    older = older_rows(rows, runtime, required)
    if runtime is None:
        return []
    if not older:
        return ["", f"Every row was measured in full on the runtime that ships (its last change: `{runtime[0]}`)."]
    return ["", f"Not measured in full on the runtime that ships (its last change to `src/`, `setup.py` or "
            f"`pyproject.toml`: `{runtime[0]}`): older, never run, or a suite of the row not run or not passed; to "
            f"be run again: {', '.join(older)}."]


def git_runtime(repo: Path = REPO):
    """(the last commit that changed the runtime, descends(commit)), or None outside a git checkout."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)

    last = git("log", "-1", "--format=%h", "--abbrev=12", "--", "src", "setup.py", "pyproject.toml")
    if last.returncode != 0 or not last.stdout.strip():
        return None
    commit = last.stdout.strip()
    return commit, lambda other: git("merge-base", "--is-ancestor", commit, other).returncode == 0


_SECONDS = re.compile(r"; (\d+) s\b")


def cost_section(slices, results_dir: Path, runtime):
    """What the pass costs: per slice, the rows measured in full on the runtime that ships, their suites' seconds
    (from the cells) and their installs' (``install.seconds``, where the matrix recorded it), and the peak disk."""
    if runtime is None:
        return []
    table_rows = []
    for name, rows, required in slices:
        current = [row for row in rows if row[0] not in older_rows([row], runtime, required)]
        suites = sum(int(m) for row in current for cell in row[2:] for m in _SECONDS.findall(cell))
        installs = [int(value) for row in current if (value := _text(results_dir / row[0] / "install.seconds"))]
        install = sum(installs)
        table_rows.append([name, f"{len(current)} of {len(rows)}", f"{suites / 60:.0f}",
                           f"{install / 60:.0f} ({len(installs)} row{'' if len(installs) == 1 else 's'})",
                           f"{(suites + install) / 60:.0f}"])
    disk = re.match(r"peak ([\d.]+ GiB) during (\S+) .*; (.+)$", _text(results_dir / "matrix-disk.txt") or "")
    return ["", "## What a pass costs", "",
            "Wall time of the rows above that were measured in full on the runtime that ships, run one at a time: the",
            "suites' seconds of their cells, and installing each release into its environment where the matrix timed",
            "it (`install.seconds`). Creating an environment and deleting it are not counted. The peak disk is the",
            "largest the matrix held (environments, op caches, pip's cache, the logs) over every run of the pass.",
            "",
            _tables().markdown_table(("slice", "rows current", "suites, min", "installs, min", "total, min"),
                                     table_rows, align="lrrrr"),
            "", f"Peak disk: {f'{disk[1]}, while {disk[2]} ran ({disk[3]})' if disk else 'not recorded'}."]


def render(results_dir: Path, versions, torches, today: str, previous: str = "", runtime=None,
           pythons=(), clients=(), full=()) -> str:
    """``runtime``: see ``git_runtime``; with it, each table ends with the rows not measured in full on the runtime
    that ships. ``full``: the releases that run the whole suites (the Makefile's FULL_VERSIONS)."""
    table = _tables().markdown_table
    kept = previous_rows(previous)

    def row(section: str, name: str, folder: Path, suites, cells, width: int):
        if not folder.is_dir() and name in kept[section]:
            # A suite added to the matrix since that row ran was not run for it.
            return (kept[section][name] + ["not run"] * width)[:width]
        return [name, measured(folder, suites), *cells(folder)]
    lines = [
        "# Supported deepspeed and torch releases",
        "",
        "Written by `make test-versions` (scripts/matrix.py, then scripts/versions_table.py) from the logs in",
        "`versions-out/`; do not edit by hand. Each row runs, one at a time, in the environment of its Python and",
        "torch with its deepspeed release installed and this package (docs/maintaining.md). Counts are pytest's",
        "closing lines; `failed` includes errors; `not run` means that suite was not run for it in the run this",
        "row comes from. `measured` is the commit the row's suites ran on and the day (each suite's when they",
        "differ); rerunning one release rewrites its row only.",
        "",
        f"Last written: {today}.",
        "",
        "## deepspeed releases",
        "",
        "torch 2.13.0 (CPU build), `deepspeed==<release>`. Every release: unit tests, one 2-rank parity launch per",
        "runtime over the Makefile's `SMOKE_SCENARIOS` (ours vs upstream's runtime of the same release, bitwise)",
        "and ours' exact-count tests (`COUNT_TESTS`, 2 ranks). The first and last patch of each minor series, the",
        "releases where the contract changes and the clients' releases (the Makefile's `FULL_VERSIONS`) run the",
        "whole suites instead: every distributed test (2 ranks, gloo) and every parity scenario (2 and 4 ranks),",
        "which include those.",
        "",
    ]
    def release_cells(folder: Path):
        results = {suite: read_suite(folder, suite) for suite in SUITES}
        return [f"in {_INSIDE[suite]}" if result is None and results.get(_INSIDE.get(suite)) is not None
                else cell(result) for suite, result in results.items()]

    rows = [row("deepspeed", version, results_dir / version, SUITES, release_cells, 2 + len(SUITES))
            for version in versions]
    lines.append(table(("deepspeed", "measured", "unit", "distributed", "parity", "parity smoke", "exact counts"),
                       rows, align="l" * (2 + len(SUITES))))
    def owed(row):  # unit, distributed, parity for a release of FULL_VERSIONS; else unit, parity smoke, counts
        return (2, 3, 4) if row[0] in full else (2, 5, 6)
    lines += staleness_line(rows, runtime, owed)
    slices = [("deepspeed, whole suites", [row for row in rows if row[0] in full], owed),
              ("deepspeed, smoke", [row for row in rows if row[0] not in full], owed)]
    lines += [
        "",
        "## torch releases",
        "",
        "`torch==<version>` (PyPI's Linux build, run on the CPU), deepspeed 0.19.8: unit tests, and one 2-rank",
        "parity launch per runtime (ours vs upstream on that torch, bitwise) over the Makefile's",
        "`TORCH_SMOKE_SCENARIOS`: training, eval alternation, `zero.Init`, checkpoint save/load, MiCS (where the",
        "release has it), activation checkpointing with frozen parameters and LoRA with gradient checkpointing",
        "(each reentrant and not), z3 leaves with data-dependent routing, and `torch.compile` with the eager,",
        "aot_eager and inductor backends. A failure of upstream's own runtime on a torch shows in the parity",
        "column with the test that reports it. Exact counts: ours' own counted tests where torch decides when a",
        "parameter is used (`TORCH_COUNT_TESTS`: release at last use in a recompute, persistent parameters under",
        "data-dependent routing), 2 ranks.",
        "",
    ]
    rows = [row("torch", torch, results_dir / f"torch-{torch}", TORCH_SUITES,
                lambda folder: [installed(folder), *(cell(read_suite(folder, suite)) for suite in TORCH_SUITES)],
                3 + len(TORCH_SUITES))
            for torch in torches]
    lines.append(table(("torch", "measured", "installed", "unit", "parity smoke", "exact counts"), rows,
                       align="l" * (3 + len(TORCH_SUITES))))
    lines += staleness_line(rows, runtime, lambda row: range(3, 3 + len(TORCH_SUITES)))
    slices.append(("torch", rows, lambda row: range(3, 3 + len(TORCH_SUITES))))
    if pythons:
        lines += [
            "",
            "## Python versions",
            "",
            "Python `<version>` (pyenv's newest patch of it), torch 2.13.0, deepspeed 0.19.8: unit tests and one",
            "2-rank parity launch per runtime over the Makefile's `SMOKE_SCENARIOS`.",
            "",
        ]
        rows = [row("python", python, results_dir / f"python-{python}", PYTHON_SUITES,
                    lambda folder: [installed(folder), *(cell(read_suite(folder, suite)) for suite in PYTHON_SUITES)],
                    3 + len(PYTHON_SUITES))
                for python in pythons]
        lines.append(table(("python", "measured", "installed", "unit", "parity smoke"), rows,
                           align="l" * (3 + len(PYTHON_SUITES))))
        lines += staleness_line(rows, runtime, lambda row: range(3, 3 + len(PYTHON_SUITES)))
        slices.append(("Python", rows, lambda row: range(3, 3 + len(PYTHON_SUITES))))
    if clients:
        lines += [
            "",
            "## Client libraries on their users' releases",
            "",
            "torch 2.13.0, the client libraries of tests/integration/requirements.txt, on the deepspeed release",
            "their users get (the Makefile's `LIGHTNING_DEEPSPEED_VERSION`, `HF_DEEPSPEED_VERSION`): each flow under",
            "our runtime against its reference, and against upstream's runtime of the same release, bitwise.",
            "",
        ]
        rows = [row("client", name, results_dir / name, (suite,),
                    lambda folder, suite=suite, what=what: [what, installed(folder), cell(read_suite(folder, suite))],
                    5)
                for name, suite, what in clients]
        lines.append(table(("row", "measured", "flows", "installed", "integration"), rows, align="lllll"))
        lines += staleness_line(rows, runtime, lambda row: (4,))
        slices.append(("clients", rows, lambda row: (4,)))
    lines += cost_section(slices, results_dir, runtime)
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) != 3:
        sys.stderr.write(__doc__)
        return 2
    results_dir, output = Path(argv[1]), Path(argv[2])
    versions, torches, pythons = supported_versions(REPO), torch_versions(REPO), python_versions(REPO)
    clients = client_rows(REPO)
    known = set(versions) | {f"torch-{torch}" for torch in torches} | {f"python-{p}" for p in pythons}
    known |= {name for name, _, _ in clients}
    known.add("fresh-install")  # scripts/fresh_install.py's logs, a page of their own
    extra = sorted(p.name for p in results_dir.iterdir() if p.is_dir() and p.name not in known) \
        if results_dir.is_dir() else []
    if extra:
        sys.stderr.write(f"versions_table: ignoring results of releases outside the matrix {extra}\n")
    previous = output.read_text() if output.exists() else ""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(render(results_dir, versions, torches, datetime.datetime.now(datetime.timezone.utc)
                             .strftime("%Y-%m-%d %H:%M UTC"), previous, git_runtime(), pythons, clients,
                             makefile_list(REPO, "FULL_VERSIONS")))
    print(output.read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
