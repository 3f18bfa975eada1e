"""Goodput (issue 44 item 4): the workdir's append-only event log survives every restart, and
`jaxscale goodput` reports productive step time over wall time, the steps lost to each
interruption and the time compiling, saving and restoring: exact on a crafted log, and
consistent with what a crashed, pre-empted and resumed run really did."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale.observe.events import EventLog, read_events
from jaxscale.observe.goodput import Interruption, analyse, format_report, goodput
from jaxscale.runtime.preemption import Preempted
from jaxscale.train.hooks import CheckpointHook
from jaxscale.train.loop import prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env()

# Three runs: killed after step 4 (its last save: step 2), pre-empted at step 4 (saved), done.
CRAFTED = [
    ("start", 0), ("compile", 10, dict(seconds=8)), ("first_step", 12, dict(step=1, seconds=1)),
    ("progress", 14, dict(step=2, seconds=4)), ("save", 15, dict(step=2, seconds=1)),
    ("progress", 19, dict(step=4, seconds=4)),
    ("start", 30), ("restore", 33, dict(step=2, seconds=2)), ("compile", 40, dict(seconds=6)),
    ("progress", 48, dict(step=4, seconds=8)), ("save", 49, dict(step=4, seconds=1)),
    ("preempted", 50, dict(step=4)),
    ("start", 60), ("restore", 61, dict(step=4, seconds=1)), ("compile", 70, dict(seconds=5)),
    ("progress", 80, dict(step=8, seconds=10)), ("save", 81, dict(step=8, seconds=1)),
    ("exit", 82, dict(step=8)),
]


def _write(workdir: str, rows) -> None:
    log = EventLog(workdir)
    for name, t, *fields in rows:
        log.record(name, at=float(t), **(fields[0] if fields else {}))
    log.close()


def test_crafted_log_gives_the_exact_numbers(tmp_path):
    _write(str(tmp_path), CRAFTED)
    g = analyse(*read_events(str(tmp_path)))
    assert (g.runs, g.first_step, g.last_step, g.finished) == (3, 0, 8, True)
    assert g.wall_s == 82 and g.compile_s == 19 and g.save_s == 3 and g.restore_s == 3
    assert g.down_s == (30 - 19) + (60 - 50)
    # Kept: steps 1-2 of run 1 (4 s), 3-4 of run 2 (8 s), 5-8 of run 3 (10 s); run 1's steps
    # 3-4 were trained again.
    assert g.productive_s == 22 and g.goodput == pytest.approx(22 / 82)
    assert g.interruptions == [Interruption(1, "killed", 4, 2, 2),
                               Interruption(2, "pre-empted", 4, 4, 0)]


def test_an_interval_cut_by_the_resume_step_counts_in_proportion(tmp_path):
    _write(str(tmp_path), [("start", 0), ("progress", 10, dict(step=4, seconds=8)),
                           ("start", 20), ("restore", 21, dict(step=1, seconds=1)),
                           ("progress", 30, dict(step=4, seconds=6)), ("exit", 31, dict(step=4))])
    g = analyse(*read_events(str(tmp_path)))
    assert g.productive_s == 8 / 4 + 6 and g.interruptions[0].lost_steps == 3


def test_command_prints_the_report_and_skips_a_line_cut_by_a_kill(tmp_path):
    _write(str(tmp_path), CRAFTED)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "progr')  # a write cut short by SIGKILL
    run = subprocess.run([sys.executable, "-m", "launch.goodput", str(tmp_path)], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "3 run(s) (2 restart(s)), steps 0->8" in run.stdout
    assert "productive          22.0 s  26.8%" in run.stdout
    assert "run 1 killed at step 4, the next resumed from step 2: 2 step(s) lost" in run.stdout
    assert "1 line(s) cut short by a kill were skipped" in run.stdout
    as_json = subprocess.run([sys.executable, "-m", "launch.goodput", str(tmp_path), "--json"],
                             cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert json.loads(as_json.stdout)["productive_s"] == 22


def test_a_workdir_without_events_is_one_paragraph(tmp_path):
    run = subprocess.run([sys.executable, "-m", "launch.goodput", str(tmp_path)], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.count("jaxscale: error:") == 1 and "events.jsonl" in run.stderr


class Crash(Exception):
    pass


class StopAt:
    """After `step` (and after the step's save and progress event: the highest order),
    raises `Crash` (a process dying) or sends SIGTERM (a pre-emption notice)."""

    order = 500

    def __init__(self, step: int, sigterm: bool = False):
        self.step, self.sigterm = step, sigterm

    def after_step(self, info):
        if info.step == self.step:
            if self.sigterm:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            else:
                raise Crash()

    def at_end(self, info):
        pass


def _config():
    c = get_config("test")
    c.train.update(steps=9, log_every=1, eval_every=0)
    c.checkpoint.every = 3
    return c


@pytest.mark.slow
def test_a_crashed_preempted_and_resumed_run_reports_what_happened(tmp_path):
    workdir = str(tmp_path)
    crashed = prepare(_config(), workdir, hooks=[StopAt(5)])
    with pytest.raises(Crash):
        crashed.run()
    [ckpt] = [h for h in crashed.hooks if isinstance(h, CheckpointHook)]
    ckpt.checkpointer.close()  # the process would have died; let step 3's save finish
    with pytest.raises(Preempted):
        prepare(_config(), workdir, hooks=[StopAt(7, sigterm=True)]).run()
    prepare(_config(), workdir).run()
    events, bad = read_events(workdir)
    assert bad == 0
    assert [e["event"] for e in events].count("start") == 3
    assert [e["step"] for e in events if e["event"] == "restore"] == [3, 7]
    assert [e["step"] for e in events if e["event"] == "save"] == [3, 6, 7, 9]
    g = analyse(events)
    assert g.interruptions == [Interruption(1, "killed", 5, 3, 2),
                               Interruption(2, "pre-empted", 7, 7, 0)]
    assert (g.first_step, g.last_step, g.finished) == (0, 9, True)
    assert 0 < g.productive_s < g.wall_s and g.compile_s > 0 and g.restore_s > 0
    assert g.productive_s + g.compile_s + g.save_s + g.restore_s <= g.wall_s


@pytest.mark.xdist_group("seaweedfs")
def test_the_event_log_on_a_bucket_workdir_gives_the_same_report(seaweedfs):
    """On s3:// (no append) each event rewrites the object whole through the storage layer;
    a second writer (the next run) continues it; the command reads it from the bucket."""
    server, bucket = seaweedfs
    workdir = f"s3://{bucket}/runs/goodput"
    _write(workdir, CRAFTED[:6])   # the first run
    _write(workdir, CRAFTED[6:])   # the runs after it, as new processes
    g = analyse(*read_events(workdir))
    assert g.productive_s == 22 and g.wall_s == 82 and len(g.interruptions) == 2
    run = subprocess.run([sys.executable, "-m", "launch.goodput", workdir, "--json"], cwd=ROOT,
                         env={**ENV, **server.env()}, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["interruptions"][0]["lost_steps"] == 2


def test_a_complete_line_with_a_bad_value_is_malformed_not_cut_by_a_kill(tmp_path):
    """A whole, valid-JSON line with `"time": "abc"` was blamed on a kill."""
    _write(str(tmp_path), CRAFTED)
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "progress", "time": "abc", "step": 9, "seconds": 1}\n')
    g = goodput(str(tmp_path))
    assert (g.unreadable_lines, g.malformed_lines) == (1, 1)
    text = format_report(str(tmp_path), g)
    assert "1 malformed line(s)" in text and "cut short" not in text
    with open(tmp_path / "events.jsonl", "a") as f:
        f.write('{"event": "progr')  # and now one cut short by a kill as well
    text = format_report(str(tmp_path), goodput(str(tmp_path)))
    assert "(1 line(s) cut short by a kill and 1 malformed line(s)" in text
