"""Elastic restarts keep the data position exact (issue 44 item 3): every data source's
iterator state is a position in *global* batches, each process taking its rows of each, so a
run that saved its position on 2 processes and resumes on 1 (or the reverse) trains on exactly
the examples an uninterrupted run would: none repeated, none skipped, checked by example id.
A real 2-process run resumed on 1 process with an uninterrupted run's losses:
tests/test_local_tier_kill.py (its one_process case, from the killed run's persistent step)."""

import dataclasses
import json

import numpy as np
import pytest

from jaxscale.data.batching import Batches
from jaxscale.data.images import ImageBatches
from jaxscale.data.mixture import MixtureBatches

GLOBAL, SEQ, BEFORE, AFTER = 8, 4, 5, 7


@dataclasses.dataclass(frozen=True)
class IdRows:
    """A row source whose every row carries its own id (source k, row i)."""

    k: int
    num_rows: int

    def row(self, i: int) -> dict[str, np.ndarray]:
        return {"tokens": np.array([self.k * 100_000 + i], np.int64)}


def _sources():
    """(name, make(process_index, process_count), ids of a batch's rows) for every source."""
    tokens = np.arange(SEQ * 500 + 1)  # a window's first token / SEQ is its id
    images, labels = np.zeros((300, 2, 2, 1), np.float32), np.arange(300)
    rows = (IdRows(0, 97), IdRows(1, 213))
    return [
        ("stdlib/tokens", lambda p, n: Batches(tokens, SEQ, GLOBAL, p, n),
         lambda b: b["tokens"][:, 0] // SEQ),
        ("digits/images", lambda p, n: ImageBatches(images, labels, GLOBAL, p, n),
         lambda b: b["labels"]),
        ("files/mixture", lambda p, n: MixtureBatches(rows, (0.3, 0.7), GLOBAL, p, n),
         lambda b: b["tokens"][:, 0]),
    ]


def _global_ids(make, ids, count: int, steps: int, state=None) -> tuple[list[list[int]], dict]:
    """The example ids of `steps` global batches read by `count` processes from `state`, and
    process 0's state after them (what a checkpoint keeps)."""
    its = [make(p, count).iterator(state) for p in range(count)]
    out = []
    for _ in range(steps):
        out.append([int(i) for it in its for i in ids(next(it))])
    states = [it.get_state() for it in its]
    assert all(s == states[0] for s in states)  # one position, the same on every process
    return out, states[0]


@pytest.mark.parametrize("name, make, ids", _sources(), ids=[s[0] for s in _sources()])
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 4)])
def test_resuming_on_another_process_count_reads_exactly_the_uninterrupted_examples(
        name, make, ids, before, after):
    whole, _ = _global_ids(make, ids, 1, BEFORE + AFTER)
    first, state = _global_ids(make, ids, before, BEFORE)
    second, _ = _global_ids(make, ids, after, AFTER, state)
    assert first + second == whole
    seen = [i for batch in first + second for i in batch]
    assert len(seen) == GLOBAL * (BEFORE + AFTER)


def test_a_source_that_cannot_reshard_its_position_is_refused_unless_accepted(
        tmp_path, monkeypatch):
    """A checkpoint written by 2 processes (its data file says so) resumed by 1: the elastic
    stdlib source keeps its position; a source registered as per-process (`elastic=False`) is
    refused in one paragraph, or restarts its position when the user accepts that."""
    from configs.tiny_lm import get_config
    from jaxscale.data import registry
    from jaxscale.errors import ConfigError
    from jaxscale.train.loop import prepare, train

    c = get_config("test")
    c.train.update(steps=2, log_every=1, eval_every=0)
    c.checkpoint.every = 2
    train(c, str(tmp_path))
    data = tmp_path / "checkpoints" / "2" / "data" / "metadata"
    data.write_text(json.dumps({"next_index": 2, "jaxscale_processes": 2}))
    c.train.steps = 4
    assert prepare(c, str(tmp_path)).data_state == {"next_index": 2}

    monkeypatch.setitem(registry.DATASETS, "perhost",
                        registry.Dataset(registry.stdlib_data, elastic=False))
    c.data.corpus = "perhost"
    with pytest.raises(ConfigError) as refused:
        prepare(c, str(tmp_path))
    assert "written by 2 processes and this run has 1" in str(refused.value)
    assert "restart_position_on_resize=True" in str(refused.value)
    assert "\n" not in str(refused.value)
    c.data.restart_position_on_resize = True
    assert prepare(c, str(tmp_path)).data_state is None
