"""Packed rows through the model: each document sees exactly what it would alone, and the loss
counts only real tokens."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_lm
from jaxscale.data.packing import SegmentRows
from jaxscale.models import ModelDef
from jaxscale.models.attention.kernels import ATTENTION_IMPLS
from jaxscale.models.decoder.lm_task import lm_loss, masked_losses
from jaxscale.precision import get_policy


class _Docs:
    def __init__(self, docs):
        self.docs, self.lengths = docs, np.asarray([len(d) for d in docs])

    def doc(self, i):
        return self.docs[i]


@pytest.fixture(scope="module")
def packed():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 256, n).astype(np.uint32) for n in (9, 5, 12, 7, 30)]
    rows = SegmentRows(_Docs(docs), width=25, pad_id=0, pack=True)
    batch = [rows.row(r) for r in range(rows.num_rows)]
    return docs, rows, {k: np.stack([b[k] for b in batch]) for k in batch[0]}


@pytest.mark.parametrize("impl", sorted(ATTENTION_IMPLS))
def test_packed_row_logits_equal_each_document_alone(packed, impl):
    docs, rows, batch = packed
    c = tiny_lm.get_config("test")
    c.model.update(attention=impl)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(1))
    forward = jax.jit(lambda p, t, pos, seg: model_def.module(p)(t, pos, segments_BT=seg))
    logits = forward(params, batch["tokens"], batch["positions"], batch["segment_ids"])
    alone = jax.jit(lambda p, t: model_def.module(p)(t))
    checked = 0
    for r, plan in enumerate(rows.plan):
        at = 0
        for d, start, n in plan:
            want = alone(params, jnp.asarray(docs[d][start:start + n][None], jnp.int32))[0]
            chex.assert_trees_all_close(logits[r, at:at + n], want, atol=1e-5, rtol=1e-5)
            at, checked = at + n, checked + 1
    assert checked >= 5 and max(len(p) for p in rows.plan) >= 2  # rows really hold several


def test_loss_counts_only_real_tokens(packed):
    _, _, batch = packed
    c = tiny_lm.get_config("test")
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(1))
    model = model_def.module(params)
    losses, mask = masked_losses(model, batch)
    seg = batch["segment_ids"]
    expected = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).sum()
    assert mask.sum() == expected and expected < seg.size  # padding and boundaries excluded
    loss = lm_loss(model, batch)
    np.testing.assert_allclose(loss, (losses * mask).sum() / expected, rtol=1e-6)
    # changing padded tokens or the token after a boundary's input does not change the loss
    noisy = dict(batch, tokens=np.where(seg == 0, 7, batch["tokens"]))
    np.testing.assert_allclose(lm_loss(model, noisy), loss, rtol=1e-6)
