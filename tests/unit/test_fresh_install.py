"""scripts/fresh_install.py: what a release installed as a user installs it must show, and its table."""

import ast

import pytest

from repo_scripts import REPO, load

fresh = load("scripts/fresh_install.py")


def passing_record():
    steps = {step: {"rc": fresh.expected_rc(step), "seconds": 3} for step in fresh.STEPS}
    steps["parity"]["summary"] = "4 passed"
    return {"measured": "abc123def456, 2026-12-07", "steps": steps, "before": "torch==2.13.0 deepspeed==0.16.0",
            "after": "torch==2.13.0 deepspeed==0.16.0", "pip_check": ["No broken requirements found."]}


def test_a_release_is_green_only_when_every_step_shows_what_a_user_expects():
    assert fresh.green(passing_record())
    moved = passing_record()
    moved["after"] = "torch==2.13.0 deepspeed==0.19.8"  # `pip install .` upgraded the user's release
    broken = passing_record()
    broken["pip_check"] = ["deepspeed 0.16.0 has requirement torch<2, but you have torch 2.13.0."]
    inactive = passing_record()
    inactive["steps"]["check"]["rc"] = 1
    leaking = passing_record()
    leaking["steps"]["kill switch"]["rc"] = 0  # the kill switch did not give upstream back
    unfinished = passing_record()
    del unfinished["steps"]["engines"]
    assert not any(fresh.green(r) for r in (moved, broken, inactive, leaking, unfinished))


def test_the_table_names_each_step_and_a_moved_release():
    moved = passing_record()
    moved["after"] = "torch==2.13.0 deepspeed==0.19.8"
    page = fresh.render({"command": "make test-fresh-install", "scenarios": "plain_mlp", "python": "3.11.7",
                         "releases": {"0.16.0": passing_record(), "0.16.9": moved}})
    rows = [line for line in page.splitlines() if line.startswith("| 0.16")]
    assert rows[0].startswith("| 0.16.0 | abc123def456, 2026-12-07 | ok | torch==2.13.0 deepspeed==0.16.0 | yes |")
    assert "| ok: 4 passed; 3 s |" in rows[0] and "| ok, exit 1; 3 s |" in rows[0]
    assert "| FAILED |" in rows[1]
    assert "no: torch==2.13.0 deepspeed==0.16.0 became torch==2.13.0 deepspeed==0.19.8" in rows[1]


def test_an_unsupported_release_is_refused_naming_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        fresh.main(["--deepspeed", "0.15.4"])
    error = capsys.readouterr().err
    assert "--deepspeed 0.15.4: not supported; pick from 0.16.0 0.16.1" in error and "0.19.8" in error


def test_the_scenarios_and_releases_it_runs_exist():
    tree = ast.parse((REPO / "tests" / "parity" / "scenarios.py").read_text())
    (assign,) = [n for n in tree.body if isinstance(n, ast.Assign)
                 and any(getattr(t, "id", None) == "SCENARIOS" for t in n.targets)]
    world_2 = [elt.id for elt in assign.value.values[0].elts]
    scenarios = ",".join(fresh.versions_table.makefile_list(REPO, "FRESH_SCENARIOS")).split(",")
    assert set(scenarios) <= set(world_2)
    releases = fresh.versions_table.makefile_list(REPO, "FRESH_VERSIONS")
    assert set(releases) <= set(fresh.versions_table.supported_versions(REPO))
    # each also runs the whole suites in the version matrix
    assert set(releases) <= set(fresh.versions_table.makefile_list(REPO, "FULL_VERSIONS"))
