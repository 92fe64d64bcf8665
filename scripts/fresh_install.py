"""A release as a user meets it: a new virtual environment, torch 2.13.0, one deepspeed release, `pip install .`.

    python3 scripts/fresh_install.py [--deepspeed 0.16.0,0.16.9] [--root DIR] [--port 29640] [--render-only]

For each release (default: the Makefile's FRESH_VERSIONS), in an environment created for it and deleted after:

1. ``pip install torch==2.13.0``, then ``pip install deepspeed==<release>``: what the user has;
2. ``pip install .`` from the repository, as README says: the deepspeed and torch it leaves, and ``pip check``;
3. ``python -m deepspeed_zero3 --check`` exits 0, and with the kill switch (``DEEPSPEED_ZERO3=0``) 1;
4. one 2-rank parity launch per runtime over ``FRESH_SCENARIOS`` (training, frozen submodules in eval,
   train/eval alternation, an inference and a training engine over one model, generating through the first):
   ours against that release's upstream, bitwise (``make venv-int test-parity-smoke``, which adds the test extra
   and the integration suite's client libraries: the generating model is transformers');
5. ``tests/distributed/test_registry.py`` on 2 ranks: two engines over one model, and over two.

Each step's exit status and seconds, and the versions before and after ``pip install .``, go to
``docs/compat/fresh-install.json`` (with the commit each release ran on) and the table to
``docs/compat/fresh-install.md``; ``--render-only`` writes the table again from the json. Logs in
``versions-out/fresh-install/<release>/``. Standard library only.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import matrix  # noqa: E402  (the version matrix: its git, default torch and op caches)
import versions_table  # noqa: E402  (this folder's table writer)

TORCH = matrix.DEFAULT_TORCH
RESULTS = REPO / "docs" / "compat" / "fresh-install.json"
PAGE = REPO / "docs" / "compat" / "fresh-install.md"
PROBE = ("import importlib.metadata as m\n"
         "print(' '.join(f'{p}=={m.version(p)}' for p in ('torch', 'deepspeed')))")
PIP_CHECK_CLEAN = "No broken requirements found."
STEPS = ("install", "pip install .", "check", "kill switch", "parity", "engines")


class Release:
    """One release's environment, log and record."""

    def __init__(self, deepspeed: str, root: Path, logs: Path, port: int):
        self.deepspeed, self.port = deepspeed, port
        self.venv = root / f"fresh-{deepspeed}"
        self.logs = logs / "fresh-install" / deepspeed
        self.record = {"steps": {}}

    def step(self, name: str, argv, env=None, cwd=REPO) -> subprocess.CompletedProcess:
        self.logs.mkdir(parents=True, exist_ok=True)
        start = time.time()
        with open(self.logs / f"{name.replace(' ', '-').replace('.', 'dot')}.log", "w") as log:
            log.write(f"$ {' '.join(map(str, argv))}\n")
            log.flush()
            environ = dict(os.environ, **(env or {}))
            environ.pop("PIP_CONSTRAINT", None)  # a site-wide cap on torch is not the user's
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ,
                                  cwd=cwd)
            log.write(done.stdout)
        self.record["steps"][name] = {"rc": done.returncode, "seconds": int(time.time() - start)}
        print(f"fresh-install {self.deepspeed}: {name}: exit {done.returncode} in {int(time.time() - start)} s",
              flush=True)
        return done

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def versions(self) -> str:
        return subprocess.run([self.bin("python"), "-c", PROBE], capture_output=True, text=True).stdout.strip()

    def run(self, ops, scenarios: str, measured: str) -> dict:
        self.record["measured"] = measured
        shutil.rmtree(self.venv, ignore_errors=True)
        script = (f"{sys.executable} -m venv {self.venv} && {self.bin('pip')} install -q --upgrade pip && "
                  f"{self.bin('pip')} install -q torch=={TORCH} && "
                  f"env -u DS_ACCELERATOR {self.bin('pip')} install -q deepspeed=={self.deepspeed}")
        if self.step("install", ["bash", "-c", script]).returncode != 0:
            return self.record
        self.record["before"] = self.versions()
        self.step("pip install .", [self.bin("pip"), "install", "-q", "."])
        self.record["after"] = self.versions()
        checked = subprocess.run([self.bin("pip"), "check"], capture_output=True, text=True)
        self.record["pip_check"] = checked.stdout.strip().splitlines()[-1:] or [checked.stderr.strip()]
        with tempfile.TemporaryDirectory() as away:  # not the repository: the installed package answers
            for name, env in (("check", {}), ("kill switch", {"DEEPSPEED_ZERO3": "0"})):
                done = self.step(name, [self.bin("python"), "-m", "deepspeed_zero3", "--check"], cwd=away, env=env)
                said = [line.split(": ", 1)[-1] for line in done.stdout.splitlines() if " overlay " in line]
                self.record["steps"][name]["summary"] = said[0] if said else ""
        make = ["make", "--no-print-directory", f"VENV={self.venv}", f"DEEPSPEED_VERSION={self.deepspeed}",
                f"PORT={self.port}", "NVME_OP=0"]
        env = {"TORCH_EXTENSIONS_DIR": str(ops(self.deepspeed))}  # the matrix's cache of this release's ops
        for name, target in (("parity", ["venv-int", "test-parity-smoke", f"SMOKE_SCENARIOS={scenarios}"]),
                             ("engines", ["test-counts", "COUNT_TESTS=tests/distributed/test_registry.py"])):
            done = self.step(name, make + target, env=env)
            counts = versions_table.summaries(done.stdout)  # a distributed run prints one line per rank
            self.record["steps"][name]["summary"] = ", ".join(
                f"{n} {outcome}" for outcome, n in counts[-1].items() if n) if counts else ""
        shutil.rmtree(self.venv, ignore_errors=True)
        return self.record


def expected_rc(step: str) -> int:
    return 1 if step == "kill switch" else 0


def green(record: dict) -> bool:
    steps = record.get("steps", {})
    return (set(steps) == set(STEPS) and all(steps[s]["rc"] == expected_rc(s) for s in STEPS)
            and record.get("before") == record.get("after") and record.get("pip_check") == [PIP_CHECK_CLEAN])


def render(results: dict) -> str:
    tables = versions_table._tables()
    rows = []
    for release, record in results["releases"].items():
        steps = record.get("steps", {})

        def cell(step):
            if step not in steps:
                return "not run"
            outcome = "ok" if steps[step]["rc"] == expected_rc(step) else f"FAILED (exit {steps[step]['rc']})"
            summary = steps[step].get("summary")
            return f"{outcome}: {summary}; {steps[step]['seconds']} s" if summary else \
                f"{outcome}, exit {steps[step]['rc']}; {steps[step]['seconds']} s"

        kept = "yes" if record.get("before") and record.get("before") == record.get("after") else \
            f"no: {record.get('before')} became {record.get('after')}"
        rows.append([release, record.get("measured", ""), "ok" if green(record) else "FAILED",
                     record.get("after", ""), kept,
                     "; ".join(record.get("pip_check", [])), cell("check"), cell("kill switch"), cell("parity"),
                     cell("engines")])
    header = ["deepspeed", "measured", "all", "after `pip install .`", "release kept", "`pip check`", "`--check`",
              "`--check`, kill switch", "parity", "two engines"]
    intro = (f"Written by `{results['command']}` (scripts/fresh_install.py); do not edit by hand; `measured` is "
             f"the commit each release ran on, and the day. Each release in a new virtual environment (Python "
             f"{results['python']}, the CPU build of torch {TORCH}), deleted after: `pip install torch=={TORCH}`, "
             f"`pip install deepspeed==<release>`, then `pip install .` from the repository. `release kept`: "
             f"deepspeed and torch are the same before and after it. `--check`: `python -m deepspeed_zero3 --check` "
             f"exits 0 (the runtime is ours); with `DEEPSPEED_ZERO3=0` it exits 1 (upstream's, untouched). "
             f"`parity`: one 2-rank launch per runtime over `{results['scenarios']}` (training, frozen submodules "
             f"in eval, train/eval alternation, an inference and a training engine over one model, generating "
             f"through the first), ours against the same release's upstream, bitwise (its skipped tests are "
             f"test_parity.py's checks of scenarios outside the list). `two engines`: "
             f"tests/distributed/test_registry.py on 2 ranks. Lightning's validate-then-fit on its users' release is "
             f"the `lightning` row of versions.md.")
    return (f"# A release as a user installs it\n\n"
            f"{textwrap.fill(intro, 115, break_long_words=False, break_on_hyphens=False)}\n\n"
            + tables.markdown_table(header, rows, align="l" * len(header)) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deepspeed", default=None, help="a comma list (default: the Makefile's FRESH_VERSIONS)")
    parser.add_argument("--root", default=str(Path.home() / ".cache" / "deepspeed-zero3-matrix"),
                        help="where the environments live while they run, and the op caches")
    parser.add_argument("--out", default=str(REPO / "versions-out"), help="the logs")
    parser.add_argument("--port", type=int, default=29640)
    parser.add_argument("--render-only", action="store_true", help="write the table again from the json")
    args = parser.parse_args(argv)
    if args.render_only:
        PAGE.write_text(render(json.loads(RESULTS.read_text())))
        return 0
    wanted = args.deepspeed.split(",") if args.deepspeed else versions_table.makefile_list(REPO, "FRESH_VERSIONS")
    supported = versions_table.supported_versions(REPO)
    unknown = [v for v in wanted if v not in supported]
    if unknown:
        parser.error(f"--deepspeed {','.join(unknown)}: not supported; pick from {' '.join(supported)}")
    scenarios = ",".join(versions_table.makefile_list(REPO, "FRESH_SCENARIOS"))
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"releases": {}}
    measured = matrix.measured_stamp()
    results.update(command="make test-fresh-install", scenarios=scenarios,
                   python=f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}")
    root = Path(args.root).expanduser()
    ops = matrix.Environment(root, matrix.default_python(), TORCH).ops  # the matrix's op cache per release
    for release in wanted:
        record = Release(release, root, Path(args.out), args.port).run(ops, scenarios, measured)
        results["releases"][release] = record
        results["releases"] = dict(sorted(results["releases"].items(),
                                          key=lambda kv: [int(x) for x in re.findall(r"\d+", kv[0])]))
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        PAGE.write_text(render(results))
    return 0 if all(green(results["releases"][r]) for r in wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
