"""The version matrix: every supported deepspeed release, every measured torch and Python, one row at a time.

    python3 scripts/matrix.py [--deepspeed all|none|0.16.0,0.16.1] [--torch all|none|2.11.0] [--python all|none|3.12]
                              [--clients all|none|lightning,hf] [--root DIR] [--commit] [--rerun] [--keep-venvs]
                              [--port 29620]

The clients' rows run the integration suite's flows on the deepspeed release their users get
(``lightning``: Lightning on ``LIGHTNING_DEEPSPEED_VERSION``, ``hf``: the Hugging Face Trainer, TRL and peft on
``HF_DEEPSPEED_VERSION``; both set in the Makefile).

One virtual environment per (Python, torch) pair, under ``--root`` (outside the repository; default
``~/.cache/deepspeed-zero3-matrix``), reused across deepspeed releases: each release is installed over the previous
one, with an op cache of its own (a few MB). The rows that share a pair run together; the pair's environment is
deleted after its last row (``--keep-venvs`` keeps them). Each suite is a make target run in that environment
(``make test-<suite> VENV=...``); its log, exit status, seconds and the commit it started on go to
``versions-out/<row>/``, the same files ``make test-versions`` writes, and after every row
``docs/compat/versions.md`` is written again (``scripts/versions_table.py``); with ``--commit`` that file alone is
committed, on the branch the matrix started on.

A row is current when each of its suites passed on a commit that descends from the last change to ``src/``,
``setup.py`` or ``pyproject.toml``: such rows are skipped, and of the other rows only the suites that are not
current run, so a pass stopped anywhere resumes where it stopped (``--rerun`` runs everything again). The disk
the matrix uses (environments, op caches, pip's cache, the logs) is sampled every 30 s; the peak is written to
``versions-out/matrix-disk.txt``. Standard library only.
"""

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import versions_table  # noqa: E402  (this folder's table writer)

DEFAULT_DEEPSPEED, DEFAULT_TORCH = "0.19.8", "2.13.0"


def makefile_value(name: str) -> list:
    return versions_table.makefile_list(REPO, name)


class Row:
    """One row of docs/compat/versions.md: its results folder, the environment it runs in and its suites."""

    def __init__(self, name: str, python: str, torch: str, deepspeed: str, suites, make_vars=(), packages=()):
        self.name, self.python, self.torch, self.deepspeed = name, python, torch, deepspeed
        self.suites, self.make_vars, self.packages = list(suites), list(make_vars), list(packages)

    @property
    def pair(self):
        return self.python, self.torch


def default_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def interpreter(python: str) -> str:
    """pyenv's newest patch of ``python`` (as the Makefile's PY_VERSION picks it), else ``python<version>``; this
    interpreter for its own version."""
    if python == default_python():
        return sys.executable
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob(f"{python}.*/bin/python{python}"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p.parent.parent.name)])
    if found:
        return str(found[-1])
    on_path = shutil.which(f"python{python}")
    if on_path is None:
        raise SystemExit(f"matrix: no Python {python} (neither {root}/{python}.* nor python{python} on PATH)")
    return on_path


CLIENTS = {"lightning": "LIGHTNING_DEEPSPEED_VERSION", "hf": "HF_DEEPSPEED_VERSION"}
CLIENT_PACKAGES = {"lightning": ["lightning"], "hf": ["transformers", "accelerate", "trl", "peft"]}


def client_row_name(client: str) -> str:
    return f"{client}-{makefile_value(CLIENTS[client])[0]}"


def plan(deepspeed, torches, pythons, clients=()):
    """The rows, grouped by environment: the default pair first (the clients' rows, short and the likeliest to find
    a difference between releases, then every deepspeed release, then its torch and Python rows at deepspeed
    0.19.8), then each other torch, then each other Python."""
    full = set(makefile_value("FULL_VERSIONS"))
    here = default_python()
    rows = [Row(client_row_name(c), here, DEFAULT_TORCH, makefile_value(CLIENTS[c])[0], [f"integration-{c}"],
                packages=CLIENT_PACKAGES[c]) for c in clients]
    # Only the whole suites reach NVMe offload (a distributed test, a parity scenario): the other rows skip building
    # the async_io op, about two of a smoke row's six minutes on 2 cores.
    rows += [Row(v, here, DEFAULT_TORCH, v, makefile_value("VERSION_SUITES"), []) if v in full else
             Row(v, here, DEFAULT_TORCH, v, makefile_value("SMOKE_VERSION_SUITES"), ["NVME_OP=0"])
             for v in deepspeed]
    rows += [Row(f"torch-{t}", here, t, DEFAULT_DEEPSPEED, makefile_value("TORCH_SUITES"), ["NVME_OP=0"])
             for t in torches]
    rows += [Row(f"python-{p}", p, DEFAULT_TORCH, DEFAULT_DEEPSPEED, makefile_value("PYTHON_SUITES"), ["NVME_OP=0"])
             for p in pythons]
    order = {(here, DEFAULT_TORCH): 0}
    for row in rows:
        order.setdefault(row.pair, len(order))
    return sorted(rows, key=lambda row: order[row.pair])  # stable: releases keep their order within a pair


def git(*argv) -> str:
    result = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def measured_stamp(*paths) -> str:
    """``<commit>[ + uncommitted changes], <day>``: what a measurement ran on. The tree counts as changed when it
    differs from the commit under ``paths`` (anywhere when none are given)."""
    limit = ("--", *paths) if paths else ()
    changed = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD", *limit]).returncode != 0
    return (f"{git('rev-parse', '--short=12', 'HEAD')}{' + uncommitted changes' if changed else ''}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}")


def suite_current(row: Row, suite: str, out: Path, runtime) -> bool:
    """The suite passed on a commit that descends from the runtime's last change, unmodified."""
    folder = out / row.name
    rc, measured = folder / f"{suite}.rc", folder / f"{suite}.measured"
    if runtime is None or not rc.exists() or not measured.exists() or rc.read_text().strip() != "0":
        return False
    text = measured.read_text()
    commits = re.findall(r"\b[0-9a-f]{12}\b", text)
    return "uncommitted" not in text and bool(commits) and runtime[1](commits[0])


def is_current(row: Row, out: Path, runtime) -> bool:
    """Every suite of the row is current (``suite_current``)."""
    return all(suite_current(row, suite, out, runtime) for suite in row.suites)


class Environment:
    """The virtual environment of one (Python, torch) pair, and which deepspeed it holds now."""

    def __init__(self, root: Path, python: str, torch: str):
        self.python, self.torch = python, torch
        self.path = root / f"venv-py{python}-torch{torch}"
        self.pin = self.path / "torch-pin.txt"
        self.ops_root = root / "ops"

    def pip(self, *argv, log):
        env = dict(os.environ)
        env.pop("DS_ACCELERATOR", None)  # a release built from its sdist imports the accelerator it names
        if self.torch != DEFAULT_TORCH:
            env["PIP_CONSTRAINT"] = str(self.pin)  # holds torch; replaces a site-wide cap
        else:
            env.pop("PIP_CONSTRAINT", None)
        run([str(self.path / "bin" / "pip"), "install", "-q", *argv], log, env=env, cwd=REPO)

    def prepare(self, deepspeed: str, log) -> None:
        # Made in full or made again: a pass stopped while the environment was being made leaves one without pip
        # or torch, which the next pass would otherwise take for made.
        made = self.path / ".matrix-made"
        if not made.exists():
            shutil.rmtree(self.path, ignore_errors=True)
            run([interpreter(self.python), "-m", "venv", str(self.path)], log)
            self.pin.write_text(f"torch=={self.torch}\n")
            self.pip("--upgrade", "pip", log=log)
            self.pip(f"torch=={self.torch}", log=log)
            made.touch()
        self.pip(f"deepspeed=={deepspeed}", log=log)
        if not (self.path / ".matrix-package").exists():
            self.pip(".[test]", log=log)
            (self.path / ".matrix-package").write_text(git("rev-parse", "HEAD") + "\n")
        # The Makefile's stamps: installed now; the launch plan, the ops and the integration packages follow the
        # release just installed.
        (self.path / ".installed").touch()
        for stamp in (".launch-plan", ".ops", ".installed-int"):
            (self.path / stamp).unlink(missing_ok=True)

    def ops(self, deepspeed: str) -> Path:
        return self.ops_root / f"{deepspeed}-py{self.python}-torch{self.torch}"


def run(argv, log, env=None, cwd=None) -> None:
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    result = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {result.returncode}")


def run_row(row: Row, environment: Environment, out: Path, port: int, suites) -> bool:
    """Run ``suites`` of the row (the others stay as they were recorded); True when they all pass."""
    folder = out / row.name
    folder.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(folder / "install.log", "w") as log:
        try:
            environment.prepare(row.deepspeed, log)
            (folder / "install.seconds").write_text(f"{int(time.time() - start)}\n")
        except RuntimeError as error:
            print(f"matrix: {row.name}: installing failed ({error}); log {folder / 'install.log'}", flush=True)
            for suite in suites:
                (folder / f"{suite}.rc").write_text("1\n")
            return False
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(environment.ops(row.deepspeed)))
    env.pop("PIP_CONSTRAINT", None)
    green = True
    for suite in suites:
        for stale in folder.glob(f"{suite}.*"):
            stale.unlink()
        (folder / f"{suite}.measured").write_text(
            measured_stamp("src", "tests", "scripts", "Makefile", "setup.py", "pyproject.toml") + "\n")
        print(f"matrix: {row.name}, {suite} (log {folder / (suite + '.log')})", flush=True)
        start = time.time()
        with open(folder / f"{suite}.log", "w") as log:
            code = subprocess.run(["make", "--no-print-directory", f"test-{suite}", f"VENV={environment.path}",
                                   f"DEEPSPEED_VERSION={row.deepspeed}", f"TORCH_VERSION={row.torch}", f"PORT={port}",
                                   *row.make_vars], stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=REPO).returncode
        (folder / f"{suite}.rc").write_text(f"{code}\n")
        (folder / f"{suite}.seconds").write_text(f"{int(time.time() - start)}\n")
        green = green and code == 0
        print(f"matrix: {row.name}, {suite}: {'ok' if code == 0 else f'FAILED (exit {code})'} in "
              f"{int(time.time() - start)} s", flush=True)
    probe = ("import sys, importlib.metadata as m; print(', '.join([f'python {sys.version.split()[0]}'] + "
             f"[f'{{p}} {{m.version(p)}}' for p in {['torch', 'deepspeed', *row.packages]!r}]))")
    installed = subprocess.run([str(environment.path / "bin" / "python"), "-c", probe], capture_output=True, text=True)
    (folder / "installed.txt").write_text(installed.stdout or installed.stderr)
    return green


class DiskWatch:
    """The bytes the matrix holds (its root, pip's cache, the results), sampled every 30 s; the peak kept."""

    def __init__(self, paths, record: Path):
        self.paths, self.record = [p for p in paths if p], record
        self.peak, self.peak_at, self.row = 0, "", "start"
        # A pass stopped and resumed is one pass: its peak is the largest of every run's.
        earlier = re.match(r"peak ([\d.]+) GiB", record.read_text()) if record.exists() else None
        if earlier:
            self.peak = int(float(earlier.group(1)) * 2**30)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def sample(self) -> int:
        total = 0
        for path in self.paths:
            if Path(path).exists():
                du = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True)
                total += int(du.stdout.split()[0]) if du.stdout else 0
        if total > self.peak:
            self.peak, self.peak_at = total, self.row
            self.record.write_text(f"peak {self.peak / 2**30:.2f} GiB during {self.peak_at} "
                                   f"({', '.join(map(str, self.paths))}); {datetime.datetime.now():%Y-%m-%d %H:%M}\n")
        return total

    def _watch(self):
        while not self.stopping.wait(30):
            self.sample()

    def __enter__(self):
        self.record.parent.mkdir(parents=True, exist_ok=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        self.sample()


def commit_table(row: Row, branch: str) -> None:
    if git("rev-parse", "--abbrev-ref", "HEAD") != branch:
        print(f"matrix: not on {branch} any more: {row.name}'s table is written, not committed", flush=True)
        return
    for _ in range(10):  # another commit in progress holds the index for a moment
        result = subprocess.run(["git", "-C", str(REPO), "commit", "-q", "-m",
                                 f"versions.md: {row.name} measured", "--", "docs/compat/versions.md"],
                                capture_output=True, text=True)
        if result.returncode == 0 or "nothing" in result.stdout + result.stderr:
            return
        time.sleep(3)
    print(f"matrix: committing {row.name}'s table failed: {result.stderr.strip()}", flush=True)


def choose(text: str, known, what: str):
    if text == "all":
        return list(known)
    if text == "none":
        return []
    wanted = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in known]
    if unknown or not wanted:
        raise SystemExit(f"matrix: --{what} {text!r}: {', '.join(unknown) or 'nothing given'} not in the matrix; "
                         f"choose all, none or from {', '.join(known)}")
    return wanted


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python3 scripts/matrix.py", description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default="all", help="releases: all (default), none, or a comma list")
    parser.add_argument("--torch", default="all", help="torch releases: all (default), none, or a comma list")
    parser.add_argument("--python", default="all", help="Python versions: all (default), none, or a comma list")
    parser.add_argument("--clients", default="all", help="client rows: all (default), none, or a comma list of "
                        + ", ".join(CLIENTS))
    parser.add_argument("--root", default=str(Path.home() / ".cache" / "deepspeed-zero3-matrix"),
                        help="where the environments and op caches live (default ~/.cache/deepspeed-zero3-matrix)")
    parser.add_argument("--out", default=str(REPO / "versions-out"), help="results folder (default versions-out/)")
    parser.add_argument("--port", type=int, default=29620, help="the launches' rendezvous port (default 29620)")
    parser.add_argument("--commit", action="store_true", help="commit docs/compat/versions.md after every row")
    parser.add_argument("--rerun", action="store_true", help="run rows that are current, too")
    parser.add_argument("--keep-venvs", action="store_true", help="keep each environment after its last row")
    args = parser.parse_args(argv)
    rows = plan(choose(args.deepspeed, versions_table.supported_versions(REPO), "deepspeed"),
                choose(args.torch, versions_table.torch_versions(REPO), "torch"),
                choose(args.python, versions_table.python_versions(REPO), "python"),
                choose(args.clients, list(CLIENTS), "clients"))
    root, out = Path(args.root), Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    runtime = versions_table.git_runtime(REPO)
    branch = git("rev-parse", "--abbrev-ref", "HEAD")
    todo = [row for row in rows if args.rerun or not is_current(row, out, runtime)]
    print(f"matrix: {len(todo)} of {len(rows)} rows to run ({len(rows) - len(todo)} current); environments in "
          f"{root}", flush=True)
    pip_cache = subprocess.run([sys.executable, "-m", "pip", "cache", "dir"], capture_output=True, text=True)
    failed, environments = [], {}
    with DiskWatch([root, pip_cache.stdout.strip() if pip_cache.returncode == 0 else None, out],
                   out / "matrix-disk.txt") as disk:
        for index, row in enumerate(todo):
            disk.row = row.name
            environment = environments.setdefault(row.pair, Environment(root, *row.pair))
            started = time.time()
            suites = [s for s in row.suites if args.rerun or not suite_current(row, s, out, runtime)]
            if not run_row(row, environment, out, args.port, suites):
                failed.append(row.name)
            subprocess.run([sys.executable, str(REPO / "scripts" / "versions_table.py"), str(out),
                            str(REPO / "docs" / "compat" / "versions.md")], stdout=subprocess.DEVNULL)
            if args.commit:
                commit_table(row, branch)
            print(f"matrix: {row.name} done in {int(time.time() - started)} s "
                  f"({index + 1} of {len(todo)}; disk now {disk.sample() / 2**30:.2f} GiB)", flush=True)
            last_of_pair = all(other.pair != row.pair for other in todo[index + 1:])
            if last_of_pair and not args.keep_venvs:
                shutil.rmtree(environment.path, ignore_errors=True)
    summary = f"matrix: {len(todo) - len(failed)} of {len(todo)} rows green"
    if failed:
        summary += f"; failed: {', '.join(failed)}"
    if (out / "matrix-disk.txt").exists():
        summary += f"; disk {(out / 'matrix-disk.txt').read_text().strip()}"
    print(summary, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
