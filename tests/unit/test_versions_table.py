"""scripts/versions_table.py: the docs/compat/versions.md table from make test-versions' logs."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("versions_table", REPO / "scripts" / "versions_table.py")
versions_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(versions_table)


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
    write_suite(results / "0.19.3", "unit", "1 passed in 1.0s\n", 0, 1)  # not supported: ignored

    text = versions_table.render(results, versions_table.supported_versions(REPO), [], "today")
    rows = [line for line in text.splitlines() if line.startswith("| 0.19.")]
    assert rows == [
        "| 0.19.4 | ok: 148 passed, 0 failed; 52 s | ok: 30 passed, 0 failed, 1 skipped (each of 2 ranks); 230 s "
        "| FAIL: 20 passed, 1 failed, 2 xfailed; 410 s |",
        "| 0.19.5 | not run | not run | not run |",
        "| 0.19.6 | not run | FAIL: stopped at its first failure (exit 2): `tests/distributed/test_x.py::test_y` "
        "| not run |",
        "| 0.19.7 | not run | not run | not run |",
        "| 0.19.8 | no pytest summary (exit 2) | FAIL: 31 passed, 0 failed (ranks disagree: rank 0 shown); 9 s "
        "| not run |",
    ]
    assert "Last written: today." in text


def test_the_torch_table_lists_every_torch_of_the_matrix_with_what_was_installed(tmp_path):
    results = tmp_path / "versions-out"
    write_suite(results / "torch-2.15.0", "unit", "252 passed, 1 skipped in 60.0s\n", 0, 61)
    write_suite(results / "torch-2.15.0", "parity-torch", "10 passed in 90.0s\n", 0, 95)
    (results / "torch-2.15.0" / "installed.txt").write_text("python 3.11.7, torch 2.15.0, deepspeed 0.19.8\n")
    write_suite(results / "torch-2.11.0", "unit", "ImportError: cannot import name 'x'\n", 4, 3)

    text = versions_table.render(results, [], ["2.11.0", "2.13.0", "2.15.0"], "today")
    rows = [line for line in text.splitlines() if line.startswith("| 2.1")]
    assert rows == [
        "| 2.11.0 | not run | no pytest summary (exit 4) | not run |",
        "| 2.13.0 | not run | not run | not run |",
        "| 2.15.0 | python 3.11.7, torch 2.15.0, deepspeed 0.19.8 | ok: 252 passed, 0 failed, 1 skipped; 61 s "
        "| ok: 10 passed, 0 failed; 95 s |",
    ]


def test_the_torch_matrix_is_read_from_the_makefile():
    assert versions_table.torch_versions(REPO) == ["2.11.0", "2.12.1", "2.13.0", "2.14.1", "2.15.0"]
