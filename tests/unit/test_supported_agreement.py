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


def test_every_supported_release_torch_and_python_has_a_row_and_nothing_else_does():
    rows = versions_table.previous_rows(PAGE)  # {section: {first cell: cells}}, in the page's order
    assert list(rows["deepspeed"]) == list(_compat.SUPPORTED_DEEPSPEED_VERSIONS)
    assert list(rows["torch"]) == list(_compat.MEASURED_TORCH_VERSIONS)
    assert list(rows["python"]) == versions_table.python_versions(REPO)
    assert list(rows["client"]) == [name for name, _, _ in versions_table.client_rows(REPO)]


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
