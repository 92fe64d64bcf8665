"""tools/upstream_compat.py's table: one release per page ([Note: a release of the compat table])."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "tools"))

import upstream_compat  # noqa: E402


def store():
    release = {"release": {"ours": {"commit": "abc123def456", "changed_files": []},
                           "upstream": {"commit": "edaa722", "version_txt": "0.19.6"}, "pytest": "8.3.5",
                           "shims": ["ddp_cpu_device_ids"], "started": "2026-12-02",
                           "machine": {"accelerator_dtypes": ["float32", "bfloat16"], "fp16": False, "cpu_flags": []}},
               "files": {}}
    collections = {rt: {"items": [{"nodeid": "unit/a/test_x.py::test_one", "stage3": True},
                                  {"nodeid": "unit/a/test_x.py::test_two", "stage3": True},
                                  {"nodeid": "unit/a/test_y.py::test_three", "stage3": True}],
                        "errors": [], "skipped_modules": [{"nodeid": "unit/a/test_fp16.py",
                                                           "reason": "fp16 is not supported on this accelerator"}]}
                   for rt in upstream_compat.RUNTIMES}
    ran = {"unit/a/test_x.py": {
        "upstream": {"unit/a/test_x.py::test_one": ("P", ""), "unit/a/test_x.py::test_two": ("P", "")},
        "ours": {"unit/a/test_x.py::test_one": ("P", ""),
                 "unit/a/test_x.py::test_two": ("NR", "did not report (timed out; log compat-out/logs/x.ours.log)")},
    }}
    upstream_compat.update_store(release, collections, ran, "2026-12-02")
    return release


def test_the_page_names_its_commit_pytest_and_fp16_support():
    page = upstream_compat.render(store())
    assert "One full run of deepspeed-zero3 commit `abc123def456` (a clean tree)" in page
    assert "Every file ran under pytest 8.3.5" in page
    assert "This CPU's fp16 support: no (DeepSpeed's CPU accelerator reports float32, bfloat16" in page
    assert "/work/" not in page  # no path outside this repository


def test_a_test_that_did_not_report_is_counted_not_run_with_why():
    page = upstream_compat.render(store())
    assert "| a/test_x.py | 2 | 2 | 2 | 2 / 0 / 0 / 0 / 0 / 0 | 1 / 0 / 0 / 0 / 0 / 1 |" in page
    assert "* `a/test_x.py` under ours: did not report (timed out" in page
    assert "| a/test_y.py | 1 | 1 | not run in this release |  |  |" in page
    assert "* `a/test_x.py::test_two`: upstream P, ours NR; **not on purpose: a bug to fix**" in page


def test_a_test_upstream_xfails_and_ours_passes_is_an_xpass_not_a_bug():
    """pytest's junit reports a non-strict XPASS as a pass: the page counts it XP under ours ([Note: XPASS from
    the two runtimes]), and the run has no unexplained difference."""
    release = store()
    collections = {rt: {"items": [{"nodeid": "unit/a/test_z.py::test_follow_up", "stage3": True}], "errors": [],
                        "skipped_modules": []} for rt in upstream_compat.RUNTIMES}
    ran = {"unit/a/test_z.py": {"upstream": {"unit/a/test_z.py::test_follow_up": ("XF", "follow-up")},
                                "ours": {"unit/a/test_z.py::test_follow_up": ("P", "")}}}
    upstream_compat.update_store(release, collections, ran, "2026-12-02")
    page = upstream_compat.render(release)
    assert "| a/test_z.py | 1 | 1 | 1 | 0 / 0 / 0 / 1 / 0 / 0 | 0 / 0 / 0 / 0 / 1 / 0 |" in page
    assert ("* `a/test_z.py::test_follow_up`: upstream XF, ours XP; XPASS under ours: upstream marks it xfail, as its "
            "own open follow-up") in page


def test_modules_skipped_at_collection_are_not_applicable_here():
    page = upstream_compat.render(store())
    assert "* `a/test_fp16.py`: fp16 is not supported on this accelerator" in page


def test_resume_needs_the_same_runtime_pytest_and_shims():
    old = store()
    fresh = {"release": dict(old["release"], ours={"commit": "fedcba987654", "changed_files": []})}
    assert upstream_compat.same_release(old, fresh, unchanged_since=lambda commit: commit == "abc123def456")
    assert not upstream_compat.same_release(old, fresh, unchanged_since=lambda commit: False)
    fresh["release"]["pytest"] = "9.2.0"
    assert not upstream_compat.same_release(old, fresh, unchanged_since=lambda commit: True)


def test_each_committed_page_is_its_results_rendered():
    """A page is a record: it says what its JSON says (the commit, and whether the runtime changed since), no more."""
    pages = sorted((Path(__file__).resolve().parent.parent.parent / "docs" / "compat").glob("upstream-unit-tests*.json"))
    assert pages
    for results in pages:
        assert results.with_suffix(".md").read_text() == upstream_compat.render(json.loads(results.read_text())), results


def checked_store(alone_outcomes):
    """store()'s run with [Note: a test run alone]'s steps, run alone by ``alone_outcomes[(runtime, nodeid)]``."""
    release = store()
    collections = {rt: {"items": [{"nodeid": "unit/a/test_x.py::test_one", "stage3": True},
                                  {"nodeid": "unit/a/test_x.py::test_two", "stage3": True}],
                        "errors": [], "skipped_modules": []} for rt in upstream_compat.RUNTIMES}
    per_runtime = {"upstream": {"unit/a/test_x.py::test_one": ("P", ""), "unit/a/test_x.py::test_two": ("P", "")},
                   "ours": {"unit/a/test_x.py::test_one": ("F", "AssertionError: not equal"),
                            "unit/a/test_x.py::test_two": ("NR", "did not report (timed out)")}}
    runs = []

    def run_alone(work, test_file, nodeid, runtime, pytest_dir, tag):
        runs.append((runtime, nodeid, tag))
        return alone_outcomes[(runtime, nodeid)].pop(0), ""

    original = upstream_compat.run_alone
    upstream_compat.run_alone = run_alone
    try:
        checks = upstream_compat.check_file(Path("."), "unit/a/test_x.py", per_runtime, None)
    finally:
        upstream_compat.run_alone = original
    upstream_compat.update_store(release, collections, {"unit/a/test_x.py": per_runtime}, "2026-12-07",
                                 {"unit/a/test_x.py": checks})
    return release, runs


def test_a_test_that_did_not_report_is_run_alone_once_and_counts():
    release, runs = checked_store({("ours", "unit/a/test_x.py::test_two"): ["P"],
                                   ("upstream", "unit/a/test_x.py::test_one"): ["P", "P", "P"],
                                   ("ours", "unit/a/test_x.py::test_one"): ["F", "P", "F"]})
    assert ("ours", "unit/a/test_x.py::test_two", "alone") in runs
    page = upstream_compat.render(release)
    assert "| a/test_x.py | 2 | 2 | 2 | 2 / 0 / 0 / 0 / 0 / 0 | 1 / **1** / 0 / 0 / 0 / 0 |" in page
    assert "* `a/test_x.py` under ours: 1" in page
    assert "Tests that did not report:" not in page


def test_a_difference_upstream_also_shows_alone_fails_at_random_under_both():
    release, runs = checked_store({("ours", "unit/a/test_x.py::test_two"): ["P"],
                                   ("upstream", "unit/a/test_x.py::test_one"): ["P", "F", "P"],
                                   ("ours", "unit/a/test_x.py::test_one"): ["P", "P", "F"]})
    assert sum(1 for rt, nodeid, tag in runs if nodeid.endswith("test_one")) == 2 * upstream_compat.REPEATS
    diff, = release["files"]["unit/a/test_x.py"]["run"]["differences"]
    assert diff["at_random"] and not upstream_compat.unexplained(diff)
    assert ("* `a/test_x.py::test_one`: upstream P, ours F; fails at random under both runtimes (run alone 3 times: "
            "upstream P/F/P, ours P/P/F)") in upstream_compat.render(release)


def test_a_difference_only_ours_shows_alone_stays_a_bug_with_its_outcomes():
    release, _ = checked_store({("ours", "unit/a/test_x.py::test_two"): ["NR"],
                                ("upstream", "unit/a/test_x.py::test_one"): ["P", "P", "P"],
                                ("ours", "unit/a/test_x.py::test_one"): ["F", "F", "P"]})
    diffs = release["files"]["unit/a/test_x.py"]["run"]["differences"]
    assert [upstream_compat.unexplained(d) for d in diffs] == [True, True]
    page = upstream_compat.render(release)
    assert ("* `a/test_x.py::test_one`: upstream P, ours F; **not on purpose: a bug to fix** (run alone 3 times: "
            "upstream P/P/P, ours F/F/P)") in page
    assert "did not report when run alone either" in page


def test_upstream_failing_with_its_own_cpu_error_is_category_u_not_a_bug():
    nodeid = "unit/runtime/zero/test_zero_leaf_module.py::TestZ3LeafOptimization::test_finegrained_optimization[12100]"
    per_runtime = {"upstream": {nodeid: ("F", "RuntimeError: Invalid device string: '0'")},
                   "ours": {nodeid: ("P", "")}}
    diff, = upstream_compat.differences(per_runtime)
    assert diff["category"] == "u" and not upstream_compat.unexplained(diff)
    per_runtime["upstream"][diff["nodeid"]] = ("F", "AssertionError")
    diff, = upstream_compat.differences(per_runtime)
    assert upstream_compat.unexplained(diff)


def test_a_test_that_hangs_here_is_not_run_alone():
    nodeid = "unit/runtime/zero/test_zero_tensor_fragment.py::TestTensorFragmentGet::test_zero_fragments[nvme-3-local]"
    per_runtime = {rt: {nodeid: ("NR", "did not report (pytest exit 1)")} for rt in upstream_compat.RUNTIMES}
    original, upstream_compat.run_alone = upstream_compat.run_alone, None  # would raise if called
    try:
        assert upstream_compat.fill_not_reported(Path("."), "unit/x.py", per_runtime, None) == {}
    finally:
        upstream_compat.run_alone = original
    outcome, why = per_runtime["ours"][nodeid]
    assert outcome == "NR" and why.startswith("did not report (pytest exit 1); not run alone: NVMe optimizer offload")


def test_a_run_alone_gets_a_shorter_per_test_timeout():
    env = upstream_compat.child_env("ours", None, DS_UNITTEST_TIMEOUT="180")
    assert env["DS_UNITTEST_TIMEOUT"] == "180" and env["DEEPSPEED_ZERO3"] == "1"


def test_upstream_failing_where_ours_passes_is_to_explain_not_a_bug_of_ours():
    release = store()
    collections = {rt: {"items": [{"nodeid": "unit/a/test_w.py::test_w", "stage3": True}], "errors": [],
                        "skipped_modules": []} for rt in upstream_compat.RUNTIMES}
    ran = {"unit/a/test_w.py": {"upstream": {"unit/a/test_w.py::test_w": ("F", "AssertionError")},
                                "ours": {"unit/a/test_w.py::test_w": ("P", "")}}}
    upstream_compat.update_store(release, collections, ran, "2026-12-07")
    assert ("* `a/test_w.py::test_w`: upstream F, ours P; **upstream fails and ours passes: to explain**"
            in upstream_compat.render(release))


def test_repeated_outcomes_are_read_as_outcomes_not_letters():
    assert upstream_compat.outcomes_of("PNRXFF") == ["P", "NR", "XF", "F"]
    assert not upstream_compat.at_random("P", "F", {"upstream": "PXFP", "ours": "PPP"})  # XF is not F
    assert upstream_compat.at_random("P", "NR", {"upstream": "PNRP", "ours": "NRPP"})


def test_a_test_known_to_fail_at_random_under_both_is_category_r():
    nodeid = ("unit/checkpoint/test_universal_checkpoint.py::TestZeROUniversalCheckpointDP::"
              "test_dp_world_size_2to2[False-True-3-dtype1]")
    diff, = upstream_compat.differences({"upstream": {nodeid: ("P", "")}, "ours": {nodeid: ("NR", "timed out")}})
    assert diff["category"] == "r" and not upstream_compat.unexplained(diff)
    torch_adam_fp32 = nodeid.replace("dtype1", "dtype2")
    diff, = upstream_compat.differences({"upstream": {torch_adam_fp32: ("P", "")}, "ours": {torch_adam_fp32: ("F", "")}})
    assert diff["category"] == "r"
    deepspeed_adam_fp32 = torch_adam_fp32.replace("False-True", "False-False")
    diff, = upstream_compat.differences({"upstream": {deepspeed_adam_fp32: ("P", "")},
                                         "ours": {deepspeed_adam_fp32: ("F", "")}})
    assert upstream_compat.unexplained(diff)


def test_a_pytest_whose_test_hanged_is_stopped_without_waiting_out_the_timeout(tmp_path, monkeypatch):
    """Upstream's DistributedTest prints HANGED_LINE and ends the session, but a rank blocked in a collective
    keeps the process alive: the driver stops it HANGED_GRACE_S later, not at the file's timeout."""
    import subprocess
    import time
    monkeypatch.setattr(upstream_compat, "HANGED_GRACE_S", 0)
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", "import time; print('x' * 5000); "
                                 "print('!!! _pytest.outcomes.Exit: Test hanged, exiting !!!', flush=True); "
                                 "time.sleep(120)"], stdout=out)
        started = time.monotonic()
        try:
            assert upstream_compat.wait_unless_hanged(proc, log_path, timeout=100, poll_s=0.2) == "hanged"
            assert time.monotonic() - started < 30
        finally:
            proc.kill()
            proc.wait()
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", "print('fine')"], stdout=out)
        assert upstream_compat.wait_unless_hanged(proc, log_path, timeout=100, poll_s=0.2) == 0


def test_a_test_one_runtime_never_ran_for_a_documented_reason_is_category_n():
    nodeid = ("unit/checkpoint/test_universal_checkpoint.py::TestZeROUniversalCheckpointDP::"
              "test_dp_world_size_2to4[False-False-3-dtype0]")
    diff, = upstream_compat.differences({"upstream": {nodeid: ("S", "bf16")}, "ours": {nodeid: ("NR", "timed out")}})
    assert diff["category"] == "n" and not upstream_compat.unexplained(diff)
    diff, = upstream_compat.differences({"upstream": {nodeid: ("S", "bf16")}, "ours": {nodeid: ("F", "boom")}})
    assert upstream_compat.unexplained(diff)
