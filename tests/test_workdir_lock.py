"""One training run per workdir (jaxscale.train.workdir_lock): a second `jaxscale train` on a
workdir in use is refused in one paragraph naming the holder, before it deletes the holder's
save in flight; a killed holder frees a local workdir at once; a bucket workdir's lease is
refused while live, taken over when stale or when its holder's pid on this host is gone, and
deleted on release; every process of a multi-process run gets the same refusal."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale.errors import MeshError
from jaxscale.storage import lease
from jaxscale.storage import locations as storage
from jaxscale.train.loop import prepare
from jaxscale.train.workdir_lock import LEASE_KEY, WorkdirInUse, acquire
from jaxscale.weights.kv import Store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOLD = ("import sys, time; from jaxscale.train.workdir_lock import acquire; "
        "acquire(sys.argv[1]); print('held', flush=True); time.sleep(600)")


def _holder(workdir) -> subprocess.Popen:
    """A process holding `workdir`'s lock (until killed), started once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], env=child_env(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _free_elsewhere(workdir) -> bool:
    """Whether another process can take `workdir`'s lock now."""
    code = "import sys; from jaxscale.train.workdir_lock import acquire; acquire(sys.argv[1])"
    return subprocess.run([sys.executable, "-c", code, str(workdir)], env=child_env(),
                          capture_output=True).returncode == 0


@pytest.mark.slow  # one `jaxscale train` (refused before its build)
def test_train_on_a_workdir_in_use_is_refused_and_deletes_nothing(tmp_path):
    workdir = tmp_path / "run"
    in_flight = workdir / "checkpoints" / "3.orbax-checkpoint-tmp-123"
    in_flight.mkdir(parents=True)
    holder = _holder(workdir)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "jaxscale", "train", "--config=tiny_lm:test",
             f"--workdir={workdir}", "--config.train.steps=3"],
            cwd=ROOT, env=child_env(JAX_PLATFORMS="cpu"), capture_output=True, text=True,
            timeout=600)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("jaxscale: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    for part in (f"--workdir={workdir} is in use by another training run: pid {holder.pid} "
                 f"on host {socket.gethostname()}, started", "save in flight",
                 "Wait for that run to end or stop it, or pass another --workdir"):
        assert part in errors[0], errors[0]
    assert in_flight.is_dir()  # the holder's save in flight was not swept away
    assert sorted(os.listdir(workdir)) == ["checkpoints", "run.lock"]  # nothing written


def _unbuildable():
    """tiny_lm:test with a mesh of more devices than there are: its build fails (make_mesh),
    after every check that loads and allocates nothing has passed."""
    c = get_config("test")
    c.mesh.data = 2 * jax.device_count()
    return c


def test_a_run_on_a_workdir_in_use_is_refused_before_its_build(tmp_path):
    holder = _holder(tmp_path)  # the build would fail (MeshError): the refusal comes first
    try:
        with pytest.raises(WorkdirInUse, match=rf"pid {holder.pid} on host"):
            prepare(_unbuildable(), str(tmp_path))
    finally:
        holder.kill()
        holder.wait()


def test_a_failed_build_leaves_no_workdir_it_created_and_keeps_an_existing_one(tmp_path):
    fresh = tmp_path / "runs" / "new"
    with pytest.raises(MeshError):
        prepare(_unbuildable(), str(fresh))
    assert os.listdir(tmp_path) == []  # neither runs/ nor runs/new is left
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("a user's file")
    with pytest.raises(MeshError):
        prepare(_unbuildable(), str(existing))
    assert sorted(os.listdir(existing)) == ["notes.txt", "run.lock"]
    assert _free_elsewhere(existing) and _free_elsewhere(fresh)  # released, either way


def test_a_killed_holder_frees_the_workdir_at_once(tmp_path):
    holder = _holder(tmp_path)
    assert not _free_elsewhere(tmp_path)
    with pytest.raises(WorkdirInUse, match=rf"pid {holder.pid} on host"):
        acquire(str(tmp_path))
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    acquire(str(tmp_path)).release()  # the kernel dropped the dead process's lock
    assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()


def test_a_second_hold_in_one_process_counts_and_never_drops_the_lock(tmp_path):
    first, second = acquire(str(tmp_path)), acquire(str(tmp_path))
    second.release()
    second.release()  # idempotent: still the first's
    assert not _free_elsewhere(tmp_path)
    first.release()
    assert _free_elsewhere(tmp_path) and (tmp_path / "run.lock").exists()  # never deleted


@pytest.fixture
def bucket_workdir(moto):
    storage.configure()
    _, bucket = moto
    yield f"s3://{bucket}/runs/a"
    storage.configure()


def _lease(workdir: str, **fields) -> Store:
    store = Store(workdir)
    store.write(LEASE_KEY, lease.lease_value("theirs", **fields))
    return store


@pytest.mark.xdist_group("moto")
def test_a_live_lease_refuses_a_second_run(bucket_workdir):
    store = _lease(bucket_workdir, host="elsewhere", pid=4242, started=time.time() - 30)
    with pytest.raises(WorkdirInUse, match=rf"--workdir={bucket_workdir} is in use by another "
                                           r"training run: pid 4242 on host elsewhere, started"):
        acquire(bucket_workdir)
    assert lease.holder(store.read(LEASE_KEY)) == "theirs"


@pytest.mark.xdist_group("moto")
def test_a_stale_lease_is_taken_over_renewed_and_deleted_on_release(bucket_workdir):
    store = Store(bucket_workdir)
    store.write(LEASE_KEY, json.dumps({"time": time.time() - 120, "token": "theirs",
                                       "host": "elsewhere", "pid": 4242}).encode())
    lock = acquire(bucket_workdir, lease_s=0.2)  # renewed every 0.05 s
    time.sleep(0.4)
    value = store.read(LEASE_KEY)
    assert lease.fields(value)["pid"] == os.getpid() and lease.age(value) < 0.2
    lock.release()
    assert store.read(LEASE_KEY) is None


@pytest.mark.xdist_group("moto")
def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(bucket_workdir):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lease(bucket_workdir, host=socket.gethostname(), pid=dead.pid)  # renewed just now
    acquire(bucket_workdir).release()
    # This process's own lease, left by an earlier run in it whose release met an outage (the
    # rerun of tests/test_checkpoint_outage.py's run): taken over too, not refused.
    _lease(bucket_workdir, host=socket.gethostname(), pid=os.getpid())
    acquire(bucket_workdir).release()


@pytest.mark.slow  # two processes joined by jax.distributed
def test_every_process_of_a_run_gets_the_refusal(tmp_path):
    (tmp_path / "hold_workdir.py").write_text(
        "from absl import app, flags\n"
        "from jaxscale.errors import exit_on_user_error\n"
        "from jaxscale.runtime import distributed\n"
        "flags.DEFINE_string('workdir', None, '')\n"
        "distributed.define_flags()\n"
        "@exit_on_user_error\n"
        "def main(argv):\n"
        "    distributed.setup()\n"
        "    from jaxscale.train.workdir_lock import hold\n"
        "    hold(flags.FLAGS.workdir)\n"
        "    print('not refused', flush=True)\n"
        "app.run(main)\n")
    holder = _holder(tmp_path / "run")
    try:
        out = subprocess.run(
            [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
             "--devices_per_process=1", "--module=hold_workdir", "--grace_s=5", "--",
             f"--workdir={tmp_path / 'run'}"],
            cwd=ROOT, env=child_env(PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}"),
            capture_output=True, text=True, timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert out.returncode == 2, (out.stdout + out.stderr)[-3000:]
    for p in (0, 1):
        assert (f"[p{p}] jaxscale: error: --workdir={tmp_path / 'run'} is in use by another "
                f"training run: pid {holder.pid}") in out.stdout, out.stdout[-3000:]
    assert "not refused" not in out.stdout
