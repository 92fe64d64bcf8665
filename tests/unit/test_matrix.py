"""scripts/matrix.py: which rows the version matrix runs, in which environment, and which it skips as current."""

import re
from pathlib import Path

import pytest

from repo_scripts import load

matrix = load("scripts/matrix.py")


def test_rows_are_grouped_by_environment_default_pair_first():
    here = matrix.default_python()
    other = "3.12" if here == "3.10" else "3.10"  # a Python of its own environment, whichever runs this
    rows = matrix.plan(["0.16.0", "0.16.1", "0.19.8"], ["2.11.0", "2.13.0"], [other, here], ["lightning", "hf"])
    assert [(row.name, row.pair, row.deepspeed) for row in rows] == [
        ("lightning-0.16.9", (here, "2.13.0"), "0.16.9"),
        ("hf-0.18.4", (here, "2.13.0"), "0.18.4"),
        ("0.16.0", (here, "2.13.0"), "0.16.0"),
        ("0.16.1", (here, "2.13.0"), "0.16.1"),
        ("0.19.8", (here, "2.13.0"), "0.19.8"),
        ("torch-2.13.0", (here, "2.13.0"), "0.19.8"),
        (f"python-{here}", (here, "2.13.0"), "0.19.8"),
        ("torch-2.11.0", (here, "2.11.0"), "0.19.8"),
        (f"python-{other}", (other, "2.13.0"), "0.19.8"),
    ]
    suites = {row.name: row.suites for row in rows}
    assert suites["0.16.0"] == ["unit", "distributed", "parity"]  # in FULL_VERSIONS
    assert suites["0.16.1"] == ["unit", "parity-smoke", "counts"]
    assert suites["lightning-0.16.9"] == ["integration-lightning"]
    assert suites["hf-0.18.4"] == ["integration-hf"]
    assert suites["torch-2.11.0"] == ["unit", "parity-torch", "counts-torch"]
    # The async_io op is built only where NVMe offload runs: the whole suites of a release.
    make_vars = {row.name: row.make_vars for row in rows}
    assert make_vars["0.16.0"] == [] and make_vars["0.16.1"] == ["NVME_OP=0"]


@pytest.mark.parametrize("text,expected", [("all", ["a", "b"]), ("none", []), ("b", ["b"]), ("b,a", ["b", "a"])])
def test_choose(text, expected):
    assert matrix.choose(text, ["a", "b"], "torch") == expected


def test_choose_names_what_is_not_in_the_matrix():
    with pytest.raises(SystemExit, match=r"--torch 'a,9.9': 9.9 not in the matrix; choose all, none or from a, b"):
        matrix.choose("a,9.9", ["a", "b"], "torch")


def _suite(folder: Path, suite: str, rc: int, measured: str):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{suite}.rc").write_text(f"{rc}\n")
    (folder / f"{suite}.measured").write_text(measured + "\n")


def test_a_row_is_current_when_every_suite_passed_on_a_descendant_of_the_runtime(tmp_path):
    row = matrix.Row("0.16.1", "3.11", "2.13.0", "0.16.1", ["unit", "counts"])
    new, old = "aaaaaaaaaaaa", "bbbbbbbbbbbb"
    runtime = ("cccccccccccc", lambda commit: commit == new)
    folder = tmp_path / "0.16.1"
    assert not matrix.is_current(row, tmp_path, runtime)  # never run
    _suite(folder, "unit", 0, f"{new}, 2026-12-07")
    assert not matrix.is_current(row, tmp_path, runtime)  # a suite missing
    _suite(folder, "counts", 0, f"{new}, 2026-12-07")
    assert matrix.is_current(row, tmp_path, runtime)
    assert not matrix.is_current(row, tmp_path, None)  # outside a git checkout nothing is current
    _suite(folder, "counts", 1, f"{new}, 2026-12-07")
    assert not matrix.is_current(row, tmp_path, runtime)  # failed
    _suite(folder, "counts", 0, f"{old}, 2026-12-06")
    assert not matrix.is_current(row, tmp_path, runtime)  # older than the runtime
    _suite(folder, "counts", 0, f"{new} + uncommitted changes, 2026-12-07")
    assert not matrix.is_current(row, tmp_path, runtime)


def test_the_stamp_names_the_checkout_and_is_read_back_as_current(tmp_path):
    """What a suite's ``.measured`` file holds, written by the matrix and the fresh-install check alike."""
    head = matrix.git("rev-parse", "--short=12", "HEAD")
    stamp = matrix.measured_stamp("src")
    assert re.fullmatch(rf"{head}( \+ uncommitted changes)?, \d{{4}}-\d{{2}}-\d{{2}}", stamp)
    row = matrix.Row("0.16.1", "3.11", "2.13.0", "0.16.1", ["unit"])
    _suite(tmp_path / "0.16.1", "unit", 0, stamp)
    current = matrix.is_current(row, tmp_path, ("cccccccccccc", lambda commit: commit == head))
    assert current == ("uncommitted" not in stamp)


def test_only_the_suites_not_current_run_again(tmp_path):
    row = matrix.Row("0.16.3", "3.11", "2.13.0", "0.16.3", ["unit", "distributed", "parity"])
    new = "aaaaaaaaaaaa"
    runtime = ("cccccccccccc", lambda commit: commit == new)
    _suite(tmp_path / "0.16.3", "unit", 0, f"{new}, 2026-12-07")
    _suite(tmp_path / "0.16.3", "distributed", 0, f"{new}, 2026-12-07")
    _suite(tmp_path / "0.16.3", "parity", 1, f"{new}, 2026-12-07")
    assert [s for s in row.suites if not matrix.suite_current(row, s, tmp_path, runtime)] == ["parity"]


def test_the_disk_peak_of_a_resumed_pass_keeps_the_earlier_runs(tmp_path):
    record = tmp_path / "matrix-disk.txt"
    record.write_text("peak 2.40 GiB during 0.16.4 (x); 2026-12-07 06:27\n")
    watch = matrix.DiskWatch([tmp_path / "nothing-here"], record)
    watch.sample()  # holds 0 bytes: not a new peak
    assert record.read_text().startswith("peak 2.40 GiB during 0.16.4")
    assert watch.peak == int(2.40 * 2**30)


def test_an_environment_left_half_made_is_made_again(tmp_path, monkeypatch):
    """A pass stopped while ``python -m venv`` ran leaves bin/python without bin/pip; the next pass remakes it."""
    environment = matrix.Environment(tmp_path, matrix.default_python(), "2.13.0")
    (environment.path / "bin").mkdir(parents=True)
    (environment.path / "bin" / "python").touch()
    stale = environment.path / "left-over"
    stale.touch()
    calls = []

    def run(argv, log, env=None, cwd=None):
        calls.append(argv[-3:])
        if argv[-2] == "venv":
            environment.path.mkdir()

    monkeypatch.setattr(matrix, "run", run)
    environment.prepare("0.16.0", log=None)
    assert not stale.exists()
    assert calls[0][-2:] == ["venv", str(environment.path)]
    assert [c[-1] for c in calls[1:]] == ["pip", "torch==2.13.0", "deepspeed==0.16.0", ".[test]"]
    calls.clear()
    environment.prepare("0.16.1", log=None)  # made now: only the release goes in
    assert [c[-1] for c in calls] == ["deepspeed==0.16.1"]
