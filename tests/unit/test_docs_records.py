"""docs/benchmarks.md shows the tables of the results files beside it, as they are: a rerun that changes a results
file without the page (or the page without a rerun) fails here."""

from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGE = (DOCS / "benchmarks.md").read_text()


def tables(text: str):
    """Each markdown table of ``text``: its consecutive lines starting with ``|``."""
    found, current = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append("\n".join(current))
            current = []
    return found


@pytest.mark.parametrize("results", ["save.md", "sync.md", "generate.md", "export.md", "hostcost.md",
                                     "offload/offload.md", "frontier/run1.md", "soak.md"])
def test_every_table_of_a_results_file_is_on_the_page(results):
    found = tables((DOCS / "results" / results).read_text())
    assert found, results
    for table in found:
        assert table in PAGE, f"{results}: a table of it is not on docs/benchmarks.md as it is:\n{table}"


@pytest.mark.parametrize("results", ["bench-b/table.md", "bench-a/table.md"])
def test_the_summary_table_of_a_bench_run_is_on_the_page(results):
    assert tables((DOCS / "results" / results).read_text())[0] in PAGE
