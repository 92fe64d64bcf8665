"""Supported means measured: _compat.py, the Makefile, README, the CHANGELOG and the version pages name one set.

A release, torch or Python the code accepts has a row in docs/compat/versions.md, and the prose states the same
span and count; whether each row is current on the runtime that ships is the page's own line under each table.
"""

import re

from repo_scripts import REPO, load

from deepspeed_zero3 import _compat

versions_table = load("scripts/versions_table.py")
PAGE = (REPO / "docs" / "compat" / "versions.md").read_text()
README = (REPO / "README.md").read_text()
CHANGELOG = (REPO / "CHANGELOG.md").read_text()


def first_column(section: str):
    """The first cell of each row of the table under the heading ``## <section>``."""
    text = PAGE.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    return [row.split("|")[1].strip() for row in rows[1:]]


def test_every_supported_release_torch_and_python_has_a_row_and_nothing_else_does():
    assert first_column("deepspeed releases") == list(_compat.SUPPORTED_DEEPSPEED_VERSIONS)
    assert first_column("torch releases") == list(_compat.MEASURED_TORCH_VERSIONS)
    assert first_column("Python versions") == versions_table.python_versions(REPO)
    assert first_column("Client libraries on their users' releases") == [
        name for name, _, _ in versions_table.client_rows(REPO)]


def test_readme_and_changelog_state_the_span_and_count_the_code_supports():
    first, last = _compat.SUPPORTED_DEEPSPEED_VERSIONS[0], _compat.SUPPORTED_DEEPSPEED_VERSIONS[-1]
    count = len(_compat.SUPPORTED_DEEPSPEED_VERSIONS)
    assert f"Every deepspeed release from {first} to {last} ({count} releases:" in README
    assert f"(`deepspeed>={first},<={last}`)" in README
    assert f"Every deepspeed release from {first} to {last} is supported" in CHANGELOG
    torches = list(_compat.MEASURED_TORCH_VERSIONS)
    spelled = ", ".join(torches[:-1]) + " and " + torches[-1]
    assert spelled in re.sub(r"\s+", " ", README)  # "torch 2.11.0, 2.12.1, ... and 2.15.0 are measured"
    oldest_python = versions_table.python_versions(REPO)[0]
    assert f"Python {oldest_python} or newer" in README


def test_the_fresh_install_page_has_each_release_the_makefile_names():
    page = (REPO / "docs" / "compat" / "fresh-install.md").read_text()
    rows = [line.split("|")[1].strip() for line in page.splitlines() if re.match(r"^\| \d", line)]
    assert rows == versions_table.makefile_list(REPO, "FRESH_VERSIONS")
