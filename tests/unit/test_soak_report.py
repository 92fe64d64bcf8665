"""The soak's verdict (deepspeed_zero3.bench.soak.report) and flag checks, on synthetic samples: no launch."""

import pytest

from deepspeed_zero3.bench.soak import options, report

STEPS = 100


def record(rss_per_step=0.0, live_at=None, hooks_change_at=None, late_record=False, hooks_after_close=0):
    """One rank's samples: flat unless told otherwise."""
    series = {
        "rss_kib": [400_000 + round(rss_per_step * i) for i in range(STEPS)],
        "malloc_kib": [90_000] * STEPS,
        "py_blocks": [1_500_000] * STEPS,
        "live_numel": [0] * STEPS,
        "zero_hooks": [106] * STEPS,
        "module_hooks": [110] * STEPS,
        "owners": [2] * STEPS,
        "traces_cached": [3] * STEPS,
        "trace_records": [2] + [3] * (STEPS - 1),
    }
    if live_at is not None:
        series["live_numel"][live_at] = 1056
    if hooks_change_at is not None:
        series["zero_hooks"][hooks_change_at:] = [110] * (STEPS - hooks_change_at)
    if late_record:
        series["trace_records"][-1] = 4
    return {"series": series, "seconds": [0.1] * STEPS, "events": [["train"]] * STEPS,
            "after_close": {"zero_hooks": hooks_after_close, "module_hooks": 4}}


META = {"steps": STEPS, "world": 2, "backend": "gloo", "model": "TinyGPT (30,592 params)"}


def build(*records, cycle=50, relaxed=False, limit=4.0):
    return report.build(list(records), META, cycle, limit, relaxed)


def failed(result):
    return [c["name"] for c in result["criteria"] if c["passed"] is False]


def test_slope_is_least_squares():
    assert report.slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert report.slope([10, 11, 12], [5, 5, 5]) == 0
    with pytest.raises(ValueError, match="at least 2"):
        report.slope([1], [1])


def test_flat_run_passes_with_exact_figures():
    result = build(record(), record())
    assert result["passed"] and not failed(result)
    rank = result["ranks"][0]
    assert rank["second_half"] == [50, 99]
    assert rank["rss_slope_kib_per_step"] == 0 and rank["rss_growth_second_half_mib"] == 0
    assert rank["live_numel_max"] == 0 and (rank["zero_hooks_min"], rank["zero_hooks_max"]) == (106, 106)
    assert (rank["trace_records_first_cycle"], rank["trace_records_after_first_cycle"]) == (3, 0)


def test_rss_slope_is_fitted_on_the_second_half_only():
    steep_warmup = record()
    steep_warmup["series"]["rss_kib"] = [300_000 + 1000 * i for i in range(50)] + [400_000] * 50
    assert build(steep_warmup, record())["ranks"][0]["rss_slope_kib_per_step"] == 0


@pytest.mark.parametrize("bad, criterion", [
    (dict(live_at=73), "live gathered numel"),
    (dict(hooks_change_at=80), "ZeRO hook count"),
    (dict(hooks_after_close=4), "ZeRO hook count"),
    (dict(rss_per_step=5.0), "RSS slope"),
    (dict(late_record=True), "no trace recorded"),
])
def test_each_criterion_fails_on_one_rank(bad, criterion):
    result = build(record(), record(**bad))
    assert not result["passed"]
    assert failed(result) == [c["name"] for c in result["criteria"] if c["name"].startswith(criterion)]


def test_relaxed_reports_but_does_not_fail_on_slope_and_trace_records():
    result = build(record(rss_per_step=5.0, late_record=True), record(), relaxed=True)
    assert result["passed"] and len(failed(result)) == 2
    assert "fail (relaxed) RSS slope" in report.table(result)
    assert not build(record(live_at=3), record(), relaxed=True)["passed"]  # the structural checks stay enforced


def test_a_run_shorter_than_one_cycle_cannot_judge_trace_records():
    result = build(record(), record(), cycle=STEPS)
    check = next(c for c in result["criteria"] if c["name"].startswith("no trace recorded"))
    assert check["passed"] is None and result["passed"]
    assert result["ranks"][0]["trace_records_after_first_cycle"] is None


def test_table_has_a_column_per_rank_and_a_line_per_criterion():
    text = report.table(build(record(), record()))
    assert "|  | rank 0 | rank 1 |" in text
    assert "| RSS slope over the second half, KiB/step | 0.000 | 0.000 |" in text
    assert sum(line.startswith("PASS ") for line in text.splitlines()) == 4
    assert text.endswith("soak passed")


def parse(*argv):
    parser = options.build_parser("soak", "test")
    return options.check_args(parser, parser.parse_args(list(argv)))


@pytest.mark.parametrize("argv, message", [
    (("--steps", "3"), "--steps must be >= 4"),
    (("--eval-every", "-1"), "--eval-every must be >= 0"),
    (("--generate-tokens", "29"), "--generate-tokens must be between 1 and 28"),
    (("--max-rss-slope", "0"), "--max-rss-slope must be > 0"),
    (("--world", "0"), "--world must be >= 1"),
])
def test_bad_flags_are_rejected_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_cycle_length_covers_every_event_kind():
    assert options.cycle_length(parse()) == 50  # lcm(2 x 5, 25, 50)
    assert options.cycle_length(parse("--eval-every", "0", "--generate-every", "0", "--engine-every", "0")) == 1
    assert options.cycle_length(parse("--eval-every", "3", "--generate-every", "4", "--engine-every", "0")) == 12
