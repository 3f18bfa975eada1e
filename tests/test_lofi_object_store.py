"""The averager on an object store: `memory://` goes through tensorstore's zarr driver and its
memory kvstore, as `gs://` and `s3://` go through theirs, and its COMMIT and CLAIM keys through
the same conditional writes. Exact averages, corrupt chunks,
partial pushes, DiLoCo and racing averagers must behave as on a local disk."""

import uuid

import numpy as np
import pytest

from jaxscale.lofi.averager import AveragerConfig, latest_average, publish_initial, run_round
from jaxscale.weights import snapshot as W
from jaxscale.weights.kv import Store
from tests.lofi_common import (
    TINY_BUDGET,
    _params,
    _push,
    _reference,
    data_dir,
    race_two_averagers,
    uncommit,
)


@pytest.fixture
def mem_store():
    st = Store(f"memory://lofi-{uuid.uuid4().hex}")
    publish_initial(st, _params(0))
    return st


def test_mean_on_an_object_store_equals_numpy_reference(mem_store):
    pushed = {w: _params(w + 1) for w in range(3)}
    samples = {0: 100, 1: 300, 2: 600}
    for w, params in pushed.items():
        _push(mem_store, w, 10, params, samples[w])
    report = run_round(mem_store, AveragerConfig(chunk_budget_bytes=1, min_workers=3))
    assert report.published and report.used == {0: 10, 1: 10, 2: 10}
    ref = _reference("mean", _params(0), [pushed[w] for w in range(3)],
                     np.array([samples[w] for w in range(3)], np.float64))
    got = latest_average(mem_store).params
    for leaf, expected in ref.items():
        np.testing.assert_allclose(got[leaf], expected, rtol=1e-6, atol=1e-6)


def test_corrupt_chunk_and_partial_push_on_an_object_store_are_skipped(mem_store):
    _push(mem_store, 0, 5, _params(1))
    _push(mem_store, 1, 5, _params(2))
    _push(mem_store, 2, 5, _params(3))
    key = f"{data_dir(mem_store, 'workers/1/5')}/arrays/layers/w/c/1"
    chunk = bytearray(mem_store.kv.read(key).result().value)
    chunk[100] ^= 0xFF
    mem_store.kv.write(key, bytes(chunk)).result()
    uncommit(mem_store, "workers/2/5")  # killed before its marker
    report = run_round(mem_store, TINY_BUDGET)
    assert report.published and report.used == {0: 5}
    assert "checksum mismatch" in report.skipped[1] and "layers/w" in report.skipped[1]
    np.testing.assert_allclose(latest_average(mem_store).params["b"], _params(1)["b"], rtol=1e-6)


def test_diloco_and_racing_averagers_on_an_object_store(mem_store):
    base = _params(0)
    for w in range(2):
        _push(mem_store, w, 5, {k: v + 1 for k, v in base.items()})
    cfg = AveragerConfig(outer="diloco", outer_lr=0.7, outer_momentum=0.9, chunk_budget_bytes=1)
    reports = race_two_averagers(mem_store.location, cfg)
    assert sorted(r.published for r in reports) == [False, True]
    assert W.average_rounds(mem_store) == [0, 1]
    np.testing.assert_allclose(latest_average(mem_store).params["layers/w"],
                               base["layers/w"] + 0.7 * (1 + 0.9), rtol=1e-6, atol=1e-6)
