"""Checkpoints, metrics.jsonl and TensorBoard on a bucket across a real object-store outage: a
SeaweedFS server of its own (killed and restarted on the same ports and data), so the shared
fixtures' servers stay up.

The server is killed right before the save of step 4 (a hook pauses the loop: the loop's hooks
run before the checkpoint hook), or inside the creation of that step's directory, so the
outage always meets a save.
A short outage costs a retry: the run ends as an uninterrupted one would (same losses, every
checkpoint complete and restorable), logging the outage once when it starts and once when it
ends. One longer than `storage.retry_s` stops with one paragraph naming the store, the endpoint
and the command that resumes, and the same run resumes once the server is back. An outage
that meets the creation of a step's directory leaves no thread behind to hold the process at
exit (orbax's writes waited 300 s for a "directory created" signal that never came)."""

import logging
import sys
import threading
import time
import traceback

import pytest
from orbax.checkpoint._src.path import atomicity

from configs.tiny_lm import get_config
from jaxscale.errors import JaxscaleError
from jaxscale.observe.metrics import read_metrics
from jaxscale.storage import locations, orbax_paths
from jaxscale.storage.retry import StoreUnavailable
from jaxscale.train.loop import train
from jaxscale.weights.restore import restore_params, saved_steps
from tests import servers

pytestmark = [pytest.mark.xdist_group("seaweedfs-checkpoint-outage")]
KILL_AT = 4  # a save step (checkpoint.every=2), between two others
STEPS = 8  # conftest.TINY_STEPS: the uninterrupted run (tiny_losses) the first test equals
SHORT = 6  # the second test's: saves 2 and 4 (the outage), and after the resume 4 and 6


@pytest.fixture(scope="module")
def own_seaweedfs():
    yield from servers.own(servers.SeaweedFS)


@pytest.fixture
def workdir(own_seaweedfs, monkeypatch):
    for key, value in own_seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    yield f"s3://{own_seaweedfs.make_bucket()}/run"
    locations.configure()


def _config(retry_s: float, steps: int = STEPS):
    c = get_config("test")
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.checkpoint.every = 2
    c.storage.retry_s = retry_s
    return c


class _PauseBeforeSave:
    """Before the checkpoint hook of step KILL_AT, once the previous save is committed: signals
    `reached` and waits for the main thread's `go` (which kills the server meanwhile)."""

    def __init__(self, workdir: str):
        self.root = locations.join(workdir, "checkpoints")
        self.reached, self.go = threading.Event(), threading.Event()

    def after_step(self, info):
        if info.step == KILL_AT:
            deadline = time.monotonic() + 120
            while KILL_AT - 2 not in saved_steps(self.root) and time.monotonic() < deadline:
                time.sleep(0.2)
            self.reached.set()
            self.go.wait(120)

    def at_end(self, info):
        pass


def _losses(workdir: str) -> list[float]:
    return [m["loss"] for m in read_metrics(workdir)]


def _assert_complete(workdir: str, newest: int) -> None:
    """Every listed step restores and the newest is `newest`; a step directory without its
    commit file (never listed, nor restored) is at most an old step's deletion cut short."""
    root = locations.join(workdir, "checkpoints")
    steps = saved_steps(root)
    assert steps and steps[0] == newest, steps
    for step in steps:
        assert "params" in restore_params(root, step)
    names = [int(p.name) for p in orbax_paths.path(root).iterdir() if p.name.isdigit()]
    assert all(n < min(steps) for n in set(names) - set(steps)), (names, steps)


@pytest.mark.slow
def test_a_server_restart_during_a_save_costs_a_retry_not_the_run(
        own_seaweedfs, workdir, caplog, tiny_losses):
    caplog.set_level(logging.WARNING, logger="jaxscale.storage")
    killer, errors = _PauseBeforeSave(workdir), []

    def run():
        try:
            train(_config(retry_s=120.0), workdir, hooks=[killer])
        except BaseException as e:  # reported by the main thread
            errors.append(e)
        finally:
            killer.reached.set()
    loop = threading.Thread(target=run)
    loop.start()
    killer.reached.wait(600)
    own_seaweedfs.kill()  # a crash, right before the save of step 4
    killer.go.set()
    servers.until_outage_logged(caplog, loop, "jaxscale.storage")
    own_seaweedfs.start()  # from the main thread: the server dies with the thread that forked it
    loop.join(600)
    assert not loop.is_alive() and not errors, errors
    assert _losses(workdir) == tiny_losses  # the same run uninterrupted (another process)
    _assert_complete(workdir, STEPS)
    down, up = servers.outage_lines(caplog, "jaxscale.storage")
    assert len(down) >= 1 and len(up) == len(down), (down, up)
    assert "retrying for up to 120 s" in down[0]


def _kill_inside_directory_creation(server, monkeypatch) -> None:
    """The server dies inside the creation of step KILL_AT's directory (orbax's commit-file step
    path): after the save began, before anything of the step is written."""
    create = atomicity.CommitFileTemporaryPath.create

    async def create_then_fail(self):
        if self.get_final().name == str(KILL_AT):
            server.kill()
        return await create(self)
    monkeypatch.setattr(atomicity.CommitFileTemporaryPath, "create", create_then_fail)


def _in_orbax(thread: threading.Thread) -> str:
    """The thread's innermost orbax frames ('' when it runs no orbax code: an idle executor
    worker or grain's prefetch thread ends at exit at once; orbax's commit threads are joined)."""
    frame = sys._current_frames().get(thread.ident)
    frames = [f for f in traceback.extract_stack(frame) if "/orbax/" in f.filename] if frame \
        else []
    return " <- ".join(f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"
                       for f in reversed(frames[-3:]))


def _assert_no_orbax_thread_holds_the_exit(started: list[threading.Thread]) -> None:
    """No non-daemon thread that the run started is left in orbax's code (the interpreter
    joins those at exit): none waits for a "directory created" signal that a failed creation
    never sends, as orbax's writes did for 300 s. The 120 s is a safety net far above a
    failing write's few seconds, not a speed check."""
    left = [t for t in started if not t.daemon]
    deadline = time.monotonic() + 120
    while any(map(_in_orbax, left)) and time.monotonic() < deadline:
        time.sleep(0.5)
    busy = {t.name: _in_orbax(t) for t in left if _in_orbax(t)}
    assert not busy, f"orbax threads the process would wait for at exit: {busy}"


def test_an_outage_longer_than_the_budget_stops_in_one_paragraph_and_resumes(
        own_seaweedfs, workdir, capfd, monkeypatch):
    before = set(threading.enumerate())
    began = time.monotonic()
    try:
        with monkeypatch.context() as patch, pytest.raises(StoreUnavailable) as err:
            _kill_inside_directory_creation(own_seaweedfs, patch)
            train(_config(retry_s=3.0, steps=SHORT), workdir)
        took = time.monotonic() - began
        _assert_no_orbax_thread_holds_the_exit([t for t in threading.enumerate()
                                                if t not in before])
    finally:
        own_seaweedfs.start()
    text = str(err.value)
    assert isinstance(err.value, JaxscaleError)  # launch.train: `jaxscale: error: ...`, exit 2
    assert "\n" not in text and own_seaweedfs.endpoint in text and workdir.split("/")[2] in text
    assert "has not answered for 3 s" in text and "config.storage.retry_s" in text
    assert "run the same command again" in text and "last complete checkpoint" in text
    assert took < 300, took  # bounded: the budget, not tensorstore's quarter of an hour
    assert "Traceback" not in capfd.readouterr().err  # the outage is not echoed as a traceback
    assert saved_steps(locations.join(workdir, "checkpoints")) == [2]
    train(_config(retry_s=3.0, steps=SHORT), workdir)  # the same run again: it resumes
    assert "resumed from" in capfd.readouterr().out
    assert [m["step"] for m in read_metrics(workdir)] == list(range(1, SHORT + 1))
    _assert_complete(workdir, SHORT)

