"""A local-tier save that fails on one process of a multi-process run (`jaxscale/train/
local_faults.py`): process 1's `checkpoint.local_dir` is renamed away mid-run and a regular file
put in its place (`tests/fault_worker.py --fault=local_tier`), which fails its saves for root too. Every process
agrees on each failure: one warning paragraph and one `local_save_failed` event name process 1,
its directory and the error, and training goes on with an uninterrupted run's losses; three
failures in a row stop every process at the same step with one paragraph (exit 2), and the
rerun resumes (one process: tests/test_local_tier.py). No process is left waiting for the launcher's grace period (300 s here: a
process it had to stop would be named in its "stopped" line)."""

import json
import os

import pytest

from fault_common import launch_two
from jaxscale.observe.events import read_events

STEPS = 8  # conftest.TINY_STEPS: the uninterrupted run's (the fixture tiny_losses)
TRAIN = ["--config=configs/tiny_lm.py:test", f"--config.train.steps={STEPS}",
         "--config.train.log_every=1", "--config.train.eval_every=0",
         "--config.checkpoint.every=4", "--config.checkpoint.local_every=1",
         "--config.checkpoint.local_keep=2"]


def _losses(workdir) -> list[float]:
    return [json.loads(line)["loss"] for line in
            open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()]


def _steps(path) -> list[int]:
    return sorted(int(n) for n in os.listdir(path) if n.isdigit())


def _launch(tmp_path, *flags: str, module: str = "tests.fault_worker"):
    return launch_two([*TRAIN, f"--config.checkpoint.local_dir={tmp_path / 'local-{process}'}",
                       f"--workdir={tmp_path / 'run'}", *flags], module)


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if "jaxscale: warning: the local" in line]


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.slow
def test_a_local_save_failing_on_one_process_is_warned_once_and_trained_past(tmp_path,
                                                                             tiny_losses):
    """Broken after step 3, mended after step 5: the saves of steps 3 and 4 fail on process 1
    (a regular file where its tier was), each warned about once by process 0 and recorded once;
    the run finishes every step with an uninterrupted run's losses, and once the directory is
    back both tiers save again."""
    run, text = _launch(tmp_path, "--break_at=3", "--mend_at=5")
    assert run.returncode == 0, text[-3000:]
    local1 = tmp_path / "local-1"
    warned = _warnings(text)
    assert len(warned) == 2, text[-3000:]
    for n, (line, step) in enumerate(zip(warned, (3, 4)), 1):
        assert line.startswith(f"[p0] jaxscale: warning: the local checkpoint tier could not "
                               f"save step {step} on process 1 ({local1}: [Errno 20] Not a "
                               "directory"), line
        assert "persistent tier still saves every 4 steps" in line
        assert f"fail in a row (this is {n})" in line
    events, _ = read_events(str(tmp_path / "run"))
    failed = [e for e in events if e["event"] == "local_save_failed"]
    assert [(e["step"], e["processes"], e["in_a_row"]) for e in failed] == [(3, [1], 1),
                                                                           (4, [1], 2)]
    assert all(e["errors"][0].startswith(f"{local1}: ") for e in failed)
    _assert_close(_losses(tmp_path / "run"), tiny_losses)
    assert _steps(tmp_path / "local-0") == _steps(local1) == [7, 8]  # saving again
    assert _steps(tmp_path / "run" / "checkpoints") == [4, 8]


@pytest.mark.slow
@pytest.mark.exhaustive
def test_two_processes_stop_together_and_resume_with_the_peers_shards(tmp_path, tiny_losses):
    """Never mended: the third failed save in a row (step 5) stops both processes with the same
    paragraph and exit status 2; a rerun with the file still there is refused at start on both,
    naming process 1; with it removed (an empty tier, like a replaced host) the rerun resumes
    from process 0's newest local step, process 1's shards from its peer, with an uninterrupted
    run's losses."""
    run, text = _launch(tmp_path, "--break_at=3")
    assert "failed processes (exit codes): {'p0': 2, 'p1': 2}" in run.stderr, text[-3000:]
    for p in (0, 1):
        assert (f"[p{p}] jaxscale: error: The local checkpoint tier (checkpoint.local_dir) "
                f"failed 3 saves in a row, the last at step 5, on process 1 "
                f"({tmp_path / 'local-1'}: [Errno 20] Not a directory") in text, text[-3000:]
    assert len(_warnings(text)) == 2
    newest = max(_steps(tmp_path / "local-0"))
    assert newest == 5  # the healthy tier's last save was committed before the stop

    refused, text = _launch(tmp_path, module="launch.train")
    for p in (0, 1):
        assert (f"[p{p}] jaxscale: error: checkpoint.local_dir cannot be used as the local tier "
                f"of process 1 (File exists: {tmp_path / 'local-1'})") in text, text[-3000:]
    os.remove(tmp_path / "local-1")
    resumed, text = _launch(tmp_path, module="launch.train")
    assert resumed.returncode == 0, text[-3000:]
    assert (f"[p0] jaxscale: resumed from step {newest} of the local tier {tmp_path / 'local-0'}"
            " (process 1 got its shards from its peers' local tiers)") in text, text[-3000:]
    _assert_close(_losses(tmp_path / "run"), tiny_losses)
