"""The stdlib corpus pipeline: deterministic, per-host shares that tile the global batch."""

import numpy as np
import pytest

from jaxscale.data.registry import Batches, eval_batches, load_corpus
from jaxscale.errors import ConfigError


@pytest.fixture(scope="module")
def corpus():
    return load_corpus(400_000)


def test_splits_are_real_text_and_disjoint(corpus):
    train, heldout = corpus
    assert len(train) >= 400_000 and len(heldout) > 10_000
    assert b"def " in train[:200_000].tobytes() and b"import" in heldout.tobytes()
    a, _ = load_corpus(400_000, "a")
    b, _ = load_corpus(400_000, "b")
    assert a[:5000].tobytes() != b[:5000].tobytes()


def test_deterministic_given_seed(corpus):
    train, _ = corpus
    first = [next(Batches(train, 32, 8, seed=3).iterator())["tokens"] for _ in range(2)]
    np.testing.assert_array_equal(first[0], first[1])
    other = next(Batches(train, 32, 8, seed=4).iterator())["tokens"]
    assert not np.array_equal(first[0], other)


def test_hosts_read_only_their_rows_of_the_same_global_batch(corpus):
    train, _ = corpus
    whole = Batches(train, 32, 8).iterator()
    hosts = [Batches(train, 32, 8, process_index=p, process_count=2).iterator() for p in (0, 1)]
    for _ in range(3):
        full = next(whole)["tokens"]
        parts = [next(h)["tokens"] for h in hosts]
        assert parts[0].shape == (4, 33)
        np.testing.assert_array_equal(np.concatenate(parts), full)


def test_iterator_state_resumes_exactly(corpus):
    train, _ = corpus
    it = Batches(train, 32, 8).iterator()
    next(it), next(it)
    state = it.get_state()
    expected = next(it)["tokens"]
    resumed = Batches(train, 32, 8).iterator(state)
    np.testing.assert_array_equal(next(resumed)["tokens"], expected)


def test_worker_shards_are_disjoint(corpus):
    train, _ = corpus
    seen = []
    for w in range(2):
        ds = Batches(train, 32, 4, shard_index=w, shard_count=2, shuffle=False).dataset()
        seen.append({row.tobytes() for i in range(5) for row in ds[i]["tokens"]})
    assert not seen[0] & seen[1]


def test_eval_batches_fixed_and_too_small_corpus_errors(corpus):
    _, heldout = corpus
    a = eval_batches(heldout, 32, 8, 2)
    b = eval_batches(heldout, 32, 8, 2)
    np.testing.assert_array_equal(a[1]["tokens"], b[1]["tokens"])
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        Batches(np.zeros(100, np.uint8), 32, 8).dataset()
