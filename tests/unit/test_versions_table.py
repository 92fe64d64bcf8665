"""scripts/versions_table.py: the docs/compat/versions.md table from make test-versions' logs."""

from pathlib import Path

from repo_scripts import REPO, load

versions_table = load("scripts/versions_table.py")


def write_suite(folder: Path, suite: str, log: str, rc: int, seconds: int):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{suite}.log").write_text(log)
    (folder / f"{suite}.rc").write_text(f"{rc}\n")
    (folder / f"{suite}.seconds").write_text(f"{seconds}\n")


def test_summaries_read_every_pytest_closing_line():
    log = ("noise 3 passed in the middle of a line\n"
           "148 passed in 49.25s\n"
           "[2026-12-01] launcher says hi\n"
           "=========== 2 failed, 40 passed, 1 skipped, 3 xfailed, 1 error, 2 warnings in 301.07s (0:05:01) ====\n")
    assert versions_table.summaries(log) == [
        dict(passed=148, failed=0, error=0, skipped=0, xfailed=0, xpassed=0),
        dict(passed=40, failed=2, error=1, skipped=1, xfailed=3, xpassed=0),
    ]
    # Two ranks' closing lines written into one line of the log.
    assert versions_table.summaries("47 passed in 84.69s (0:01:24)47 passed in 84.69s (0:01:24)\n") == [
        dict(passed=47, failed=0, error=0, skipped=0, xfailed=0, xpassed=0)] * 2


def test_the_table_lists_every_supported_release_with_counts_or_not_run(tmp_path):
    results = tmp_path / "versions-out"
    write_suite(results / "0.19.4", "unit", "148 passed in 49.25s\n", 0, 52)
    write_suite(results / "0.19.4", "distributed", "30 passed, 1 skipped in 200.0s\n30 passed, 1 skipped in 200.1s\n",
                0, 230)
    write_suite(results / "0.19.4", "parity", "1 failed, 20 passed, 2 xfailed in 400.0s\n", 2, 410)
    write_suite(results / "0.19.8", "unit", "Traceback: the venv did not build\n", 2, 5)
    write_suite(results / "0.19.8", "distributed", "31 passed in 2.0s\n30 passed, 1 failed in 2.0s\n", 1, 9)
    write_suite(results / "0.19.6", "distributed", "[rank 0] FAILED tests/distributed/test_x.py::test_y (call):\n"
                "[rank 1] FAILED tests/distributed/test_x.py::test_y (call):\n", 2, 60)
    write_suite(results / "0.15.4", "unit", "1 passed in 1.0s\n", 0, 1)  # not supported: ignored
    # A release without the whole suites: its smoke and counts.
    write_suite(results / "0.19.5", "unit", "100 passed in 39.0s\n", 0, 40)
    write_suite(results / "0.19.5", "parity-smoke", "9 passed in 88.0s\n", 0, 90)
    write_suite(results / "0.19.5", "counts", "12 passed in 70.0s\n12 passed in 70.1s\n", 0, 80)

    text = versions_table.render(results, versions_table.supported_versions(REPO), [], "today")
    assert "| 0.15.4 |" not in text
    rows = [line for line in text.splitlines() if line.startswith("| 0.19.")]
    assert rows[:4] == [f"| 0.19.{patch} | not recorded | not run | not run | not run | not run | not run |"
                        for patch in range(4)]
    assert rows[4:] == [
        "| 0.19.4 | not recorded | ok: 148 passed, 0 failed; 52 s | ok: 30 passed, 0 failed, 1 skipped (each of 2 ranks); 230 s "
        "| FAIL: 20 passed, 1 failed, 2 xfailed; 410 s | in parity | in distributed |",
        "| 0.19.5 | not recorded | ok: 100 passed, 0 failed; 40 s | not run | not run | ok: 9 passed, 0 failed; 90 s "
        "| ok: 12 passed, 0 failed (each of 2 ranks); 80 s |",
        "| 0.19.6 | not recorded | not run | FAIL: stopped at its first failure (exit 2): `tests/distributed/test_x.py::test_y` "
        "| not run | not run | in distributed |",
        "| 0.19.7 | not recorded | not run | not run | not run | not run | not run |",
        "| 0.19.8 | not recorded | no pytest summary (exit 2) | FAIL: 31 passed, 0 failed (ranks disagree: rank 0 shown); 9 s "
        "| not run | not run | in distributed |",
    ]
    assert "Last written: today." in text


def test_the_torch_table_lists_every_torch_of_the_matrix_with_what_was_installed(tmp_path):
    results = tmp_path / "versions-out"
    write_suite(results / "torch-2.15.0", "unit", "252 passed, 1 skipped in 60.0s\n", 0, 61)
    write_suite(results / "torch-2.15.0", "parity-torch", "10 passed in 90.0s\n", 0, 95)
    (results / "torch-2.15.0" / "installed.txt").write_text("python 3.11.7, torch 2.15.0, deepspeed 0.19.8\n")
    (results / "torch-2.15.0" / "measured.txt").write_text("0123456789ab, 2026-12-03\n")
    write_suite(results / "torch-2.11.0", "unit", "ImportError: cannot import name 'x'\n", 4, 3)

    text = versions_table.render(results, [], ["2.11.0", "2.13.0", "2.15.0"], "today")
    rows = [line for line in text.splitlines() if line.startswith("| 2.1")]
    assert rows == [
        "| 2.11.0 | not recorded | not run | no pytest summary (exit 4) | not run | not run |",
        "| 2.13.0 | not recorded | not run | not run | not run | not run |",
        "| 2.15.0 | 0123456789ab, 2026-12-03 | python 3.11.7, torch 2.15.0, deepspeed 0.19.8 | ok: 252 passed, 0 failed, 1 skipped; 61 s "
        "| ok: 10 passed, 0 failed; 95 s | not run |",
    ]


def test_the_python_table_lists_every_python_of_the_matrix(tmp_path):
    results = tmp_path / "versions-out"
    write_suite(results / "python-3.13", "unit", "300 passed in 40.0s\n", 0, 41)
    write_suite(results / "python-3.13", "parity-smoke", "8 passed, 1 skipped in 90.0s\n", 0, 95)
    (results / "python-3.13" / "installed.txt").write_text("python 3.13.0, torch 2.13.0, deepspeed 0.19.8\n")
    (results / "python-3.13" / "measured.txt").write_text("0123456789ab, 2026-12-04\n")

    text = versions_table.render(results, [], [], "today", pythons=["3.10", "3.13"])
    assert "## Python versions" in text
    rows = [line for line in text.splitlines() if line.startswith("| 3.1")]
    assert rows == [
        "| 3.10 | not recorded | not run | not run | not run |",
        "| 3.13 | 0123456789ab, 2026-12-04 | python 3.13.0, torch 2.13.0, deepspeed 0.19.8 | ok: 300 passed, 0 failed; "
        "41 s | ok: 8 passed, 0 failed, 1 skipped; 95 s |",
    ]
    # A rerun of another row keeps this one from the page.
    again = versions_table.render(tmp_path / "empty", [], [], "later", previous=text, pythons=["3.10", "3.13"])
    assert [line for line in again.splitlines() if line.startswith("| 3.13")] == rows[1:]
    assert versions_table.python_versions(versions_table.REPO) == ["3.10", "3.11", "3.12", "3.13"]


OLD_PAGE = """Last written: 2026-12-02 17:54 UTC.

## deepspeed releases

| deepspeed | unit | distributed | parity |
| --- | --- | --- | --- |
| 0.19.4 | ok: 256 passed, 0 failed; 57 s | not run | not run |
| 0.19.8 | ok: 1 passed, 0 failed; 5 s | not run | not run |

## torch releases

| torch | installed | unit | parity smoke |
| --- | --- | --- | --- |
| 2.13.0 | python 3.11.7, torch 2.13.0 | ok: 254 passed, 0 failed; 20 s | ok: 14 passed, 0 failed; 87 s |
"""


def test_a_release_without_results_keeps_its_row_from_the_page_and_one_rerun_rewrites_its_own(tmp_path):
    results = tmp_path / "versions-out"
    write_suite(results / "0.19.8", "unit", "250 passed in 9.0s\n", 0, 10)
    (results / "0.19.8" / "unit.measured").write_text("0123456789ab + uncommitted changes, 2026-12-03\n")

    text = versions_table.render(results, ["0.19.4", "0.19.8"], ["2.13.0", "2.15.0"], "today", OLD_PAGE)
    rows = [line for line in text.splitlines() if line.startswith(("| 0.19.", "| 2.1"))]
    assert rows == [
        "| 0.19.4 | commit not recorded, 2026-12-02 | ok: 256 passed, 0 failed; 57 s | not run | not run | not run "
        "| not run |",
        "| 0.19.8 | 0123456789ab + uncommitted changes, 2026-12-03 | ok: 250 passed, 0 failed; 10 s | not run "
        "| not run | not run | not run |",
        # The page's row, and "not run" for the suite added since.
        "| 2.13.0 | commit not recorded, 2026-12-02 | python 3.11.7, torch 2.13.0 | ok: 254 passed, 0 failed; 20 s "
        "| ok: 14 passed, 0 failed; 87 s | not run |",
        "| 2.15.0 | not recorded | not run | not run | not run | not run |",
    ]
    # A page in the current layout is carried over cell for cell.
    assert versions_table.render(tmp_path / "none", ["0.19.4", "0.19.8"], ["2.13.0", "2.15.0"], "today", text) == text


def test_each_suite_names_the_commit_it_ran_on_when_they_differ(tmp_path):
    folder = tmp_path / "versions-out" / "0.19.4"
    for suite, commit in (("unit", "aaaaaaaaaaaa"), ("distributed", "aaaaaaaaaaaa"), ("parity", "bbbbbbbbbbbb")):
        # A whole-suites row: the smoke and counts suites did not run on their own.
        write_suite(folder, suite, "1 passed in 1.0s\n", 0, 1)
        (folder / f"{suite}.measured").write_text(f"{commit}, 2026-12-03\n")
    (folder / "measured.txt").write_text("cccccccccccc, 2026-12-02\n")  # folder-wide: used only without these
    assert versions_table.measured(folder, versions_table.SUITES) == (
        "unit: aaaaaaaaaaaa, 2026-12-03; distributed: aaaaaaaaaaaa, 2026-12-03; parity: bbbbbbbbbbbb, 2026-12-03")
    (folder / "parity.measured").write_text("aaaaaaaaaaaa, 2026-12-03\n")
    assert versions_table.measured(folder, versions_table.SUITES) == "aaaaaaaaaaaa, 2026-12-03"
    for suite in ("unit", "distributed", "parity"):
        (folder / f"{suite}.measured").unlink()
    assert versions_table.measured(folder, versions_table.SUITES) == "cccccccccccc, 2026-12-02"


def test_the_torch_matrix_is_read_from_the_makefile():
    assert versions_table.torch_versions(REPO) == ["2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]


def write_smoke_row(folder: Path, commit: str):
    for suite, summary in (("unit", "250 passed in 9.0s"), ("parity-smoke", "8 passed in 50.0s"),
                           ("counts", "22 passed in 60.0s")):
        write_suite(folder, suite, summary + "\n", 0, 10)
        (folder / f"{suite}.measured").write_text(f"{commit}, 2026-12-03\n")


def test_rows_older_than_the_runtime_are_named_under_their_table(tmp_path):
    results = tmp_path / "versions-out"
    write_smoke_row(results / "0.19.8", "bbbbbbbbbbbb")
    write_smoke_row(results / "0.19.4", "aaaaaaaaaaaa")
    runtime = ("cccccccccccc", lambda commit: commit == "bbbbbbbbbbbb")  # only b descends from the last change
    text = versions_table.render(results, ["0.19.4", "0.19.8"], ["2.15.0"], "today", runtime=runtime)
    assert ("Not measured in full on the runtime that ships (its last change to `src/`, `setup.py` or "
            "`pyproject.toml`: `cccccccccccc`): older, never run, or a suite of the row not run or not passed; to be "
            "run again: 0.19.4.") in text
    assert "to be run again: 2.15.0." in text  # not run at all: no commit, so not current either
    current = ("cccccccccccc", lambda commit: True)
    assert "Every row was measured in full on the runtime that ships" in versions_table.render(
        results, ["0.19.4", "0.19.8"], [], "today", runtime=current)
    assert "Not measured" not in versions_table.render(results, ["0.19.4", "0.19.8"], [], "today")  # no git: no claim


def test_a_row_missing_or_failing_a_suite_it_owes_is_not_current(tmp_path):
    """A release of FULL_VERSIONS owes unit, distributed and parity; the others unit, parity smoke and counts."""
    results = tmp_path / "versions-out"
    write_smoke_row(results / "0.16.1", "bbbbbbbbbbbb")  # complete as a smoke row
    write_smoke_row(results / "0.16.2", "bbbbbbbbbbbb")
    write_suite(results / "0.16.2", "counts", "1 failed, 21 passed in 60.0s\n", 1, 10)
    write_smoke_row(results / "0.16.4", "bbbbbbbbbbbb")  # a full release with the smoke's suites only
    current = ("cccccccccccc", lambda commit: True)
    text = versions_table.render(results, ["0.16.1", "0.16.2", "0.16.4"], [], "today", runtime=current,
                                 full=["0.16.4"])
    assert "to be run again: 0.16.2, 0.16.4." in text


def test_the_clients_table_names_each_row_release_and_what_it_ran(tmp_path):
    results = tmp_path / "versions-out"
    write_suite(results / "lightning-0.16.9", "integration-lightning", "9 passed in 300.0s\n", 0, 310)
    (results / "lightning-0.16.9" / "installed.txt").write_text(
        "python 3.11.7, torch 2.13.0, deepspeed 0.16.9, lightning 2.6.6\n")
    clients = versions_table.client_rows(versions_table.REPO)
    assert [name for name, _, _ in clients] == ["lightning-0.16.9", "hf-0.18.4"]

    text = versions_table.render(results, [], [], "today", clients=clients)
    rows = [line for line in text.splitlines() if line.startswith(("| lightning-", "| hf-"))]
    assert rows == [
        "| lightning-0.16.9 | not recorded | Lightning's flows (tests/integration/test_lightning.py) | python 3.11.7, "
        "torch 2.13.0, deepspeed 0.16.9, lightning 2.6.6 | ok: 9 passed, 0 failed; 310 s |",
        "| hf-0.18.4 | not recorded | the Hugging Face Trainer, TRL and peft flows (tests/integration/test_hf.py, "
        "test_clients.py) | not run | not run |",
    ]
    again = versions_table.render(tmp_path / "empty", [], [], "later", previous=text, clients=clients)
    assert [line for line in again.splitlines() if line.startswith("| lightning-")] == rows[:1]


def test_what_a_pass_costs_counts_the_current_rows_suites_and_installs(tmp_path):
    results = tmp_path / "versions-out"
    write_smoke_row(results / "0.16.1", "bbbbbbbbbbbb")  # 3 suites of 10 s
    (results / "0.16.1" / "install.seconds").write_text("90\n")
    write_smoke_row(results / "0.16.2", "aaaaaaaaaaaa")  # older: not counted
    (results / "matrix-disk.txt").write_text(
        "peak 2.40 GiB during 0.16.4 (/somewhere/matrix, /somewhere/pip); 2026-12-07 06:27\n")
    runtime = ("cccccccccccc", lambda commit: commit == "bbbbbbbbbbbb")
    text = versions_table.render(results, ["0.16.1", "0.16.2"], [], "today", runtime=runtime)
    assert "| deepspeed, smoke | 1 of 2 | 0 | 2 (1 row) | 2 |" in text  # 30 s of suites, 90 s installing
    assert "| deepspeed, whole suites | 0 of 0 | 0 | 0 (0 rows) | 0 |" in text
    assert "Peak disk: 2.40 GiB, while 0.16.4 ran (2026-12-07 06:27)." in text
    assert "/somewhere" not in text
