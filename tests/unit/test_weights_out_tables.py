"""The tables `bench --save` and `bench --sync` write (docs/results/save.md, sync.md), from their results."""

import json
from pathlib import Path

from deepspeed_zero3.bench import save, sync

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


def test_the_committed_save_table_is_what_its_results_give():
    rows = json.loads((RESULTS / "save.json").read_text())["rows"]
    assert save.table(rows) == (RESULTS / "save.md").read_text()
    ours = {row["layers"]: row for row in rows if row["method"] == "ours"}
    assert [row["equal"] for row in ours.values()] == [True, True]


def test_the_committed_sync_tables_are_what_their_results_give():
    results = json.loads((RESULTS / "sync.json").read_text())
    assert sync.tables(results) == (RESULTS / "sync.md").read_text()
    assert all(side["equal"] in (True, None) for side in results["methods"].values())


def test_save_ratios_are_against_upstream_of_the_same_size():
    rows = [dict(method=m, layers=n, parameters=1000 * n, wall_s=w, all_gathers=1, broadcasts=0, all_reduces=0,
                 peak_rise_mb=1.0, retained_mb=0.5, after_trim_mb=0.1, files=1)
            for m, n, w in (("upstream", 4, 2.0), ("ours", 4, 0.5), ("upstream", 8, 4.0), ("ours", 8, 3.0))]
    lines = save.table(rows).splitlines()[2:]
    assert [line.split(" | ")[4] for line in lines] == ["1.00", "0.25", "1.00", "0.75"]
