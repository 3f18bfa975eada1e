"""Packed rows (segment ids, per-document positions) through the pipeline schedules and split
steps: the loss and gradients of one packed batch equal the plain one-program step's.

The parts a step splits a batch into (pipeline microbatches, data replicas, accumulation
microbatches) hold different numbers of real targets, so the comparison also checks that the
loss stays the mean over the batch's real targets (not a mean of the parts' means).
"""

import jax
import numpy as np
import pytest

from jaxscale.data.packing import SegmentRows
from jaxscale.rules import use_rules
from jaxscale.train.loop import Trainer
from jaxscale.train.step import accumulate_grads
from jaxscale.weights.tree import flatten
from tests.test_parallel_equivalence import make_config


class _Docs:
    def __init__(self, docs):
        self.docs, self.lengths = docs, np.asarray([len(d) for d in docs])

    def doc(self, i):
        return self.docs[i]


@pytest.fixture(scope="module")
def packed_batch() -> dict[str, np.ndarray]:
    """16 packed rows of 33 tokens whose real-target counts differ from row to row."""
    rng = np.random.default_rng(3)
    docs = [rng.integers(1, 256, n).astype(np.uint32) for n in rng.integers(2, 40, 60)]
    rows = SegmentRows(_Docs(docs), width=33, pad_id=0, pack=True)
    batch = [rows.row(r) for r in range(16)]
    out = {k: np.stack([b[k] for b in batch]) for k in batch[0]}
    seg = out["segment_ids"]
    counts = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).sum(axis=1)
    assert len(set(counts.tolist())) > 3 and (seg == 0).any()  # uneven rows, some padding
    return out


def _loss_and_grads(config, batch, pipelined: bool) -> tuple[float, dict]:
    trainer = Trainer.build(config, workdir=None, devices=jax.devices())
    ctx = trainer.ctx
    run_layers = ctx.run_layers if pipelined else None
    assert (run_layers is not None) == pipelined

    @jax.jit
    def grads(state, batch):
        with use_rules(ctx.rules, ctx.mesh):
            return accumulate_grads(state.params, state.frozen, batch, ctx.model_def,
                                    ctx.grad_accum, run_layers)

    loss, g = jax.device_get(grads(trainer.state, trainer.to_global(batch)))
    return float(loss), {k: np.asarray(v) for k, v in flatten(g).items()}


@pytest.fixture(scope="module")
def reference(packed_batch):
    """One program on one device: the packed loss is the mean over all real targets."""
    config = make_config({})
    trainer = Trainer.build(config, workdir=None, devices=jax.devices()[:1])
    ctx = trainer.ctx
    fn = jax.jit(lambda s, b: accumulate_grads(s.params, s.frozen, b, ctx.model_def, 1, None))
    loss, g = jax.device_get(fn(trainer.state, trainer.to_global(packed_batch)))
    return float(loss), {k: np.asarray(v) for k, v in flatten(g).items()}


@pytest.mark.parametrize("mesh, schedule, microbatches, grad_accum", [
    pytest.param({"pipeline": 2, "data": 4}, "gpipe", 2, 1, marks=pytest.mark.exhaustive),
    ({"pipeline": 2, "data": 4}, "1f1b", 2, 1),
    ({"pipeline": 4, "data": 2}, "1f1b", 4, 2),
    ({"data": 8}, "gpipe", 1, 2),  # no pipeline: accumulation over data replicas
])
def test_packed_batch_through_split_steps_equals_one_program(packed_batch, reference, mesh,
                                                              schedule, microbatches,
                                                              grad_accum):
    config = make_config(mesh, "pp" if "pipeline" in mesh else "",
                         microbatches=microbatches, schedule=schedule)
    config.train.grad_accum = grad_accum
    loss, grads = _loss_and_grads(config, packed_batch, "pipeline" in mesh)
    want_loss, want = reference
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert set(grads) == set(want)
    for k in want:
        assert np.linalg.norm(grads[k] - want[k]) <= 1e-5 * np.linalg.norm(want[k]) + 1e-7, k
