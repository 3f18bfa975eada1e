"""bench/chaos.py cannot rot: its verdict logic (table, exit status, skips and failures) and
its bad-input table (bench/chaos_bad_input.py), run for real, in seconds. The full suite is
`make chaos`."""

import re

import pytest

from bench import chaos, chaos_bad_input


def _results() -> list:
    results: list = []
    chaos.check(results, "s", "ok", "holds", lambda: "fine")
    chaos.check(results, "s", "skipped", "holds", lambda: (_ for _ in ()).throw(chaos.Skip("no")))

    def fails():
        raise AssertionError("one is not two | really")
    chaos.check(results, "s", "broken", "holds", fails)
    chaos.check(results, "s", "crashed", "holds", lambda: {}["key"])
    return results


def test_each_check_is_timed_and_judged():
    ok, skipped, failed, crashed = _results()
    assert (ok.status, ok.detail) == ("pass", "fine")
    assert (skipped.status, skipped.detail) == ("skipped", "skipped: no")
    assert (failed.status, failed.detail) == ("FAIL", "one is not two | really")
    assert crashed.status == "FAIL" and crashed.detail.startswith("KeyError")
    assert all(r.seconds >= 0 for r in (ok, skipped, failed, crashed))


def test_the_table_has_one_row_per_check_and_escapes_pipes():
    lines = chaos.table(_results()).split("\n")
    assert lines[0] == "| scenario | injected | invariant | result | time |"
    assert len(lines) == 2 + 4
    cells = [re.split(r"(?<!\\)\|", line)[1:-1] for line in lines]
    assert all(len(row) == 5 for row in cells), cells  # a `|` in a detail is escaped
    assert "| pass: fine |" in lines[2] and "FAIL: one is not two \\| really" in lines[4]


def test_exit_status_is_1_only_when_an_invariant_failed():
    ok, skipped, failed, crashed = _results()
    assert chaos.exit_code([ok, skipped]) == 0
    assert chaos.exit_code([ok, failed]) == 1 and chaos.exit_code([crashed]) == 1
    assert chaos.exit_code([]) == 0


def test_every_subcommand_has_bad_inputs(tmp_path):
    cases = chaos_bad_input.bad_inputs(chaos_bad_input.bad_input_files(str(tmp_path)))
    covered = {subcommand for subcommand, _, _ in cases}
    assert covered == {"train", "evaluate", "generate", "convert", "inspect", "compile", "plan",
                       "prepare-data", "lofi-local", "lofi-average", "plot", "profile-summary",
                       "goodput", "lm-eval", "local-multihost"}
    assert all(sum(s == c for s, _, _ in cases) >= 3 for c in covered)


@pytest.mark.parametrize("subcommand", ["train", "evaluate", "generate", "convert", "inspect",
                                        "compile", "plan", "prepare-data", "lofi-local",
                                        "lofi-average", "plot", "profile-summary",
                                        "goodput", "lm-eval", "local-multihost"])
def test_the_bad_input_table_runs(subcommand, tmp_path, capsys):
    if subcommand == "lm-eval":
        pytest.importorskip("lm_eval")
    results: list = []
    chaos_bad_input.scenario_bad_inputs(results, str(tmp_path), {subcommand})
    assert len(results) >= 3
    assert chaos.exit_code(results) == 0, chaos.table(results)
