"""One process of a multi-process run failing with a plain error (`jaxscale/runtime/
peer_failure.py`): process 1 of 2 raises a RuntimeError after step 3 (`tests/fault_worker.py
--fault=raise`). Before, both processes waited on each other until JAX's 300 s shutdown
timeout, then aborted with pages of C++ logs; now process 1 reports its traceback, process 0 a
paragraph naming process 1 and its error, both leave through JAX's shutdown barrier (no
abort), and the rerun resumes from the last checkpoint. The launcher's grace period is 300 s,
so a process it had to stop would be named in its "stopped" line: the assertions are about the
behaviour, not a timeout."""

import os

import pytest

from fault_common import STEPS, TRAIN, launch_two, losses_by_step
from jaxscale.runtime.peer_failure import stopped_message, together


@pytest.mark.slow
def test_one_process_failing_stops_every_process_and_the_rerun_resumes(tmp_path):
    workdir = tmp_path / "run"
    run, text = launch_two([*TRAIN, f"--workdir={workdir}", "--fault=raise", "--break_at=3"],
                           traceback=True)
    assert "failed processes (exit codes): {'p0': 2, 'p1': 1}" in run.stderr, text[-3000:]
    assert "[p1] RuntimeError: injected on process 1 after step 3" in text, text[-3000:]
    stopped = next(x for x in text.splitlines() if x.startswith("[p0] jaxscale: error:"))
    assert stopped.startswith(
        "[p0] jaxscale: error: Process 1 of 2 failed: RuntimeError: injected on process 1 after "
        "step 3. Process 0 stopped with it instead of waiting for it"), stopped
    for noise in ("Terminating process", "Shutdown barrier", "[p0] Traceback"):
        assert noise not in text, text[-3000:]  # no abort, no coordination-service logs
    first = losses_by_step(workdir)
    assert sorted(first) == [1, 2, 3]
    assert os.listdir(workdir / "checkpoints") == ["2"]

    # The rerun needs no saves of its own (checkpoint.every=0, the later flag wins): its resume
    # is the point.
    resumed, text = launch_two([*TRAIN, f"--workdir={workdir}", "--config.checkpoint.every=0"],
                               module="launch.train")
    assert resumed.returncode == 0, text[-3000:]
    assert f"[p0] jaxscale: resumed from {workdir}/checkpoints/2 (persistent tier)" in text
    again = losses_by_step(workdir)
    assert sorted(again) == list(range(1, STEPS + 1))
    assert again[3] == pytest.approx(first[3], rel=1e-5)


def test_the_stopped_paragraph_names_the_first_failure_and_the_others():
    text = stopped_message({3: "ValueError: bad record.", 1: "RuntimeError: boom"}, 0, 4)
    assert text.startswith("Process 1 of 4 failed (process 3 failed too): RuntimeError: boom. "
                           "Process 0 stopped with it")
    assert "run the same command again" in text


def test_a_single_process_run_is_left_alone():
    """No coordination service: the error propagates as it is, nothing is published."""
    with pytest.raises(RuntimeError, match="plain"):
        with together():
            raise RuntimeError("plain")
    with together():
        pass
