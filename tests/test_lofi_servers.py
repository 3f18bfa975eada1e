"""The Lo-Fi store on real S3 servers (SeaweedFS and moto) and a GCS emulator, through
jaxscale.storage.locations (endpoint from AWS_ENDPOINT_URL_S3, credentials from AWS_*): pushes are
listed and read back, a round's average is bit-for-bit the average of the same pushes on a
local disk, an uncommitted push is not used, and of two averagers racing on one round exactly
one commit wins (both servers honour If-None-Match, which storage.py makes tensorstore send)."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from jaxscale.lofi import store as S
from jaxscale.lofi.averager import AveragerConfig, latest_average, publish_initial, run_round
from jaxscale.weights import snapshot as W
from jaxscale.weights.kv import Store
from tests.lofi_common import KILL_MID_PUSH, ROOT, _params, _push, race_two_averagers, uncommit

SERVERS = [pytest.param("seaweedfs", marks=pytest.mark.xdist_group("seaweedfs")),
           pytest.param("moto", marks=pytest.mark.xdist_group("moto"))]


@pytest.fixture(params=SERVERS)
def s3_location(request):
    _, bucket = request.getfixturevalue(request.param)
    return f"s3://{bucket}/lofi/run1"


def _round_of_three(location: str) -> tuple[object, dict]:
    st = Store(location)
    publish_initial(st, _params(0))
    for w, samples in ((0, 100), (1, 300), (2, 600)):
        _push(st, w, 10, _params(w + 1), samples)
    _push(st, 2, 20, _params(9))
    uncommit(st, S.worker_prefix(2, 20))  # a worker killed before its COMMIT
    report = run_round(st, AveragerConfig(chunk_budget_bytes=1, min_workers=3))
    return report, st


def test_round_on_an_s3_server_equals_the_local_store_bit_for_bit(s3_location, tmp_path):
    report, st = _round_of_three(s3_location)
    assert report.published and report.used == {0: 10, 1: 10, 2: 10}
    assert S.worker_pushes(st) == {0: [10], 1: [10], 2: [10]}
    assert W.average_rounds(st) == [0, 1]
    local_report, local = _round_of_three(str(tmp_path / "store"))
    assert local_report.used == report.used
    got, want = latest_average(st).params, latest_average(local).params
    assert sorted(got) == sorted(want)
    for leaf in want:
        np.testing.assert_array_equal(got[leaf], want[leaf])
    # Bytes actually went through the server: a fresh reader sees the same average.
    again = latest_average(Store(s3_location)).params
    for leaf in want:
        np.testing.assert_array_equal(again[leaf], want[leaf])


@pytest.mark.xdist_group("fake-gcs")
def test_round_on_a_gcs_emulator_equals_the_local_store_bit_for_bit(fake_gcs, tmp_path):
    """The gs:// data path (fake-gcs-server ignores generation preconditions: no race here)."""
    _, bucket = fake_gcs
    report, st = _round_of_three(f"gs://{bucket}/lofi/run1")
    assert report.published and report.used == {0: 10, 1: 10, 2: 10}
    _, local = _round_of_three(str(tmp_path / "store"))
    got, want = latest_average(st).params, latest_average(local).params
    for leaf in want:
        np.testing.assert_array_equal(got[leaf], want[leaf])


def test_two_averagers_racing_on_an_s3_round_commit_once(s3_location):
    st = Store(s3_location)
    base = _params(0)
    publish_initial(st, base)
    for w in range(2):
        _push(st, w, 5, {k: v + 1 for k, v in base.items()})
    reports = race_two_averagers(s3_location, AveragerConfig(chunk_budget_bytes=1))
    assert sorted(r.published for r in reports) == [False, True]
    assert W.average_rounds(st) == [0, 1]
    np.testing.assert_allclose(latest_average(st).params["layers/w"], base["layers/w"] + 1,
                               rtol=1e-6)


@pytest.mark.xdist_group("seaweedfs")
def test_lofi_store_on_an_unusable_bucket_is_one_paragraph(seaweedfs, monkeypatch):
    """A worker or averager pointed at a missing bucket or with refused credentials stops at
    once with the location and the fix, before any push or round."""
    from jaxscale.storage.locations import StorageError

    server, bucket = seaweedfs
    with pytest.raises(StorageError, match="bucket 'jaxscale-missing' does not exist"):
        Store("s3://jaxscale-missing/lofi")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StorageError, match=r"s3://.*/lofi/denied.*refused the credentials"):
        Store(f"s3://{bucket}/lofi/denied")


def test_worker_killed_mid_push_on_an_s3_server_leaves_nothing_a_reader_uses(s3_location):
    st = Store(s3_location)
    publish_initial(st, {"a": np.zeros(10, np.float32), "b": np.zeros(5, np.float32)})
    _push(st, 0, 7, {"a": np.full(10, 2, np.float32), "b": np.full(5, 2, np.float32)})
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", KILL_MID_PUSH, s3_location], env=env, cwd=ROOT,
                          capture_output=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert st.keys("workers/3/7/")  # its first leaf reached the server...
    assert S.worker_pushes(st) == {0: [7]}  # ...but without a COMMIT nobody lists or reads it
    report = run_round(st, AveragerConfig(chunk_budget_bytes=1))
    assert report.published and report.used == {0: 7}
    # The restarted worker pushes the same step again, into a fresh attempt directory.
    again = _push(st, 3, 7, {"a": np.full(10, 4, np.float32), "b": np.full(5, 4, np.float32)})
    assert not again.skipped and S.worker_pushes(st) == {0: [7], 3: [7]}
    np.testing.assert_array_equal(W.read_params(st, W.load_snapshot(st, "workers/3/7"))["a"],
                                  np.full(10, 4, np.float32))
