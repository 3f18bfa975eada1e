"""The Lo-Fi store across a real object-store outage: a SeaweedFS server of its own (killed
and restarted on the same ports and data), so the shared fixtures' servers stay up.

A round that starts while the server is down rides the outage out with bounded backoff, logs
it once when it starts and once when it ends, and publishes exactly the average it would have
published anyway; a longer outage than `storage.retry_s` stops with one paragraph naming the
location, the endpoint and the fix, and leaves no COMMIT behind. An object deleted under a
running averager drops that worker's push (data, not weather) without waiting out a budget."""

import logging
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from child_env import child_env
from jaxscale.lofi import store as S
from jaxscale.lofi.averager import AveragerConfig, latest_average, publish_initial, run_round
from jaxscale.storage import locations
from jaxscale.storage.retry import StoreUnavailable
from jaxscale.weights import snapshot as W
from jaxscale.weights.kv import Store
from tests import servers
from tests.lofi_common import ROOT, _params, _push, data_dir

pytestmark = [pytest.mark.xdist_group("seaweedfs-outage")]


@pytest.fixture(scope="module")
def own_seaweedfs():
    yield from servers.own(servers.SeaweedFS)


@pytest.fixture
def location(own_seaweedfs, monkeypatch):
    for key, value in own_seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    locations.configure(retry_s=120.0, timeout_s=30.0)
    yield f"s3://{own_seaweedfs.make_bucket()}/lofi"
    locations.configure()


def _three_pushes(location: str) -> tuple[Store, dict]:
    st = Store(location)
    publish_initial(st, _params(0))
    pushed = {w: _params(w + 1) for w in range(3)}
    for w, params in pushed.items():
        _push(st, w, 10, params)
    return st, pushed


def test_a_round_rides_out_a_server_restart_and_publishes_the_same_average(
        own_seaweedfs, location, caplog):
    st, pushed = _three_pushes(location)
    caplog.set_level(logging.WARNING, logger="jaxscale.lofi")
    own_seaweedfs.kill()  # a crash, mid-run: every request now fails to connect
    reports = []
    averager = threading.Thread(target=lambda: reports.append(
        run_round(st, AveragerConfig(chunk_budget_bytes=1, min_workers=3))))
    averager.start()
    servers.until_outage_logged(caplog, averager)
    own_seaweedfs.start()  # from this thread: the server dies with the thread that forked it
    averager.join()
    (report,) = reports
    assert report.published and report.used == {0: 10, 1: 10, 2: 10}, report.note
    down, up = servers.outage_lines(caplog)
    # One line for the outage, not one per request. A freshly restarted server may still answer
    # a request or two with InternalError while it loads its volumes: a second, short blip,
    # reported and recovered on its own (seen on a loaded 2-core machine).
    assert 1 <= len(down) <= 2 and len(up) == len(down), (down, up)
    assert location in down[0] and "retrying for up to 120 s" in down[0]
    want = {k: (pushed[0][k] + pushed[1][k] + pushed[2][k]) / 3 for k in pushed[0]}
    got = latest_average(Store(location)).params
    for leaf, value in want.items():
        np.testing.assert_allclose(got[leaf], value, rtol=1e-6, atol=1e-6)


def test_an_outage_longer_than_the_budget_stops_in_one_paragraph_and_commits_nothing(
        own_seaweedfs, location):
    st, _ = _three_pushes(location)
    locations.configure(retry_s=3.0, timeout_s=30.0)
    own_seaweedfs.kill()
    try:
        began = time.monotonic()
        with pytest.raises(StoreUnavailable) as err:
            run_round(st, AveragerConfig(chunk_budget_bytes=1, min_workers=3))
        took = time.monotonic() - began
    finally:
        own_seaweedfs.start()
    text = str(err.value)
    assert "\n" not in text and location in text and own_seaweedfs.endpoint in text
    assert "has not answered for 3 s" in text and "config.storage.retry_s" in text
    # Bounded: the budget plus the in-flight attempts' own few-second request retries, not
    # tensorstore's default quarter of an hour (a safety margin for a loaded machine).
    assert took < 120, took
    assert W.average_rounds(Store(location)) == [0]  # nothing partial was published


def test_an_object_deleted_under_the_averager_drops_that_push_at_once(location, caplog):
    st, pushed = _three_pushes(location)
    key = f"{data_dir(st, S.worker_prefix(1, 10))}/arrays/layers/w/c/1"
    st.delete(key)  # gone between listing and reading: a missing object, not an outage
    caplog.set_level(logging.WARNING, logger="jaxscale.lofi")
    report = run_round(st, AveragerConfig(chunk_budget_bytes=1, min_workers=2))
    assert report.published and report.used == {0: 10, 2: 10}
    assert "layers/w" in report.skipped[1]
    assert servers.outage_lines(caplog) == ([], [])
    got = latest_average(st).params
    np.testing.assert_allclose(got["b"], (pushed[0]["b"] + pushed[2]["b"]) / 2, rtol=1e-6)


def _lofi_job(store: str, workdir, *extra: str) -> list[str]:
    """Three workers (one CPU device each) and a watching averager, DiLoCo every 2 steps."""
    return [sys.executable, "-m", "launch.lofi_local", "--num_workers=3",
            "--devices_per_worker=1", f"--store={store}", f"--workdir={workdir}",
            "--sync=diloco", "--", "--config=configs/tiny_lm.py:test",
            "--config.lofi.sync_every=2", "--config.train.steps=6",
            "--config.train.eval_every=0", *extra]


def _wait_for_round(location: str, round_: int, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        if round_ in W.average_rounds(Store(location)):
            return
        time.sleep(0.5)
    raise AssertionError(f"the job ended before round {round_}: {proc.stdout.read()[-3000:]}")


@pytest.mark.exhaustive
@pytest.mark.slow
def test_three_workers_and_an_averager_survive_a_server_restart_bit_for_bit(
        own_seaweedfs, location, tmp_path):
    """Separate processes on SeaweedFS, the server killed for ~10 s after round 1 (workers are
    pushing step 4 and polling for round 2): the job finishes, each process says so once in its
    log, and every published average equals the same job on a local store bit for bit."""
    env = child_env()
    local = subprocess.run(_lofi_job(str(tmp_path / "store"), tmp_path / "local"), env=env,
                           cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    proc = subprocess.Popen(_lofi_job(location, tmp_path / "s3"), env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_round(location, 1, proc)
        own_seaweedfs.kill()
        time.sleep(10.0)
        own_seaweedfs.start()
        out, _ = proc.communicate(timeout=1200)
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    down = [line for line in out.splitlines() if "did not answer" in line]
    assert down and len(down) == len({line.split("|")[0] for line in down}), down  # once each
    assert "answers again" in out
    s3, disk = Store(location), Store(str(tmp_path / "store"))
    assert W.average_rounds(s3) == W.average_rounds(disk) and len(W.average_rounds(s3)) >= 4
    for round_ in W.average_rounds(disk):
        got = W.read_params(s3, W.load_snapshot(s3, W.average_prefix(round_)))
        want = W.read_params(disk, W.load_snapshot(disk, W.average_prefix(round_)))
        for leaf in want:
            np.testing.assert_array_equal(got[leaf], want[leaf], err_msg=f"round {round_}")
    assert (tmp_path / "s3" / "final" / "commits" / "params").exists()
