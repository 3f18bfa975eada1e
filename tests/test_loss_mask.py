"""Loss masks (`loss_mask`, chat's assistant tokens): one normalisation everywhere.

The next-token loss of rows with a loss mask is the mean over the targets it marks (and, in
packed rows, that lie inside their document): checked against a hand computation from the
model's logits; unchanged by every way a step splits the batch (fsdp x tensor, GPipe and 1F1B
microbatches, gradient accumulation, data replicas), whose parts hold different numbers of
counted targets; and the held-out loss of the loop and `jaxscale evaluate` count the same
targets.
"""

from __future__ import annotations

import json
import random

import jax
import numpy as np
import pytest

from configs import tiny_lm
from jaxscale.data.chat import with_mask
from jaxscale.data.packing import SegmentRows
from jaxscale.models import ModelDef
from jaxscale.models.decoder.lm_task import lm_loss, prepare_batch
from jaxscale.precision import get_policy
from tests.chat_common import WORDS, tokenizer_dir
from tests.test_packing_pipeline import _Docs, _loss_and_grads
from tests.test_parallel_equivalence import make_config


class _ChatDocs(_Docs):
    """Documents of a chat source: their trained tokens marked (`chat.with_mask`)."""

    class reader:  # what `chat_sources.kind_of` asks of a source
        kind = "chat"


def _masked_batch(packed: bool, rows: int = 16, width: int = 33, seed: int = 5) -> dict:
    """Rows of chat-like documents whose trained tokens (the mask) differ from row to row."""
    rng = np.random.default_rng(seed)
    docs = []
    for n in rng.integers(3, 30, 80):
        ids = rng.integers(1, 256, n)
        docs.append(with_mask(ids, rng.random(n) < rng.uniform(0.1, 0.9)))
    out = SegmentRows(_ChatDocs(docs), width, pad_id=0, pack=packed, masked=True)
    batch = [out.row(r) for r in range(rows)]
    batch = {k: np.stack([b[k] for b in batch]) for k in batch[0]}
    if not packed:
        del batch["segment_ids"], batch["positions"]
    return batch


def _hand_loss(model, batch) -> float:
    """The mean cross entropy over the targets that count, from the model's logits in numpy."""
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    count = batch["loss_mask"][:, 1:] > 0
    rows = {}
    if "segment_ids" in batch:
        seg = batch["segment_ids"]
        count = count & (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
        rows = dict(positions_BT=batch["positions"][:, :-1], segments_BT=seg[:, :-1])
    logits = np.asarray(model(inputs, rows.get("positions_BT"), **(
        {"segments_BT": rows["segments_BT"]} if rows else {})), np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float(-(picked * count).sum() / count.sum())


@pytest.mark.parametrize("packed", [True, False])
def test_masked_loss_is_the_mean_over_marked_targets(packed):
    model_def = ModelDef.build(tiny_lm.get_config("test").model, get_policy("32-true"))
    model = model_def.module(model_def.init_params(jax.random.key(0)))
    batch = _masked_batch(packed, rows=4)
    assert 0 < batch["loss_mask"].mean() < 0.9
    want = _hand_loss(model, batch)
    got = float(jax.jit(lm_loss)(model, batch))
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # The batch-wide count `prepare` adds is what a split step divides each part by.
    prepared = prepare_batch(batch)
    np.testing.assert_allclose(float(jax.jit(lm_loss)(model, prepared)), want, rtol=1e-5)
    half = {k: v[:2] for k, v in prepared.items()}
    other = {k: v[2:] for k, v in prepared.items()}
    parts = (float(jax.jit(lm_loss)(model, half)) + float(jax.jit(lm_loss)(model, other))) / 2
    np.testing.assert_allclose(parts, want, rtol=1e-5)


def test_rows_keep_the_marks_and_train_on_all():
    doc = with_mask([5, 6, 7, 8, 9], [0, 0, 1, 1, 0])
    source = _ChatDocs([doc, doc])
    assistant = SegmentRows(source, 12, 0, pack=True, masked=True, train_on="assistant").row(0)
    assert assistant["tokens"].tolist() == [5, 6, 7, 8, 9] * 2 + [0, 0]
    assert assistant["loss_mask"].tolist() == [0, 0, 1, 1, 0] * 2 + [0, 0]
    every = SegmentRows(source, 12, 0, pack=True, masked=True, train_on="all").row(0)
    assert every["loss_mask"].tolist() == [1] * 10 + [0, 0]


@pytest.fixture(scope="module")
def reference_runs():
    """Loss and gradients of each masked batch (packed or not) as one program on one device."""
    batches = {packed: _masked_batch(packed) for packed in (True, False)}
    got = _loss_and_grads_on(make_config({}), list(batches.values()), jax.devices()[:1])
    return {packed: (batches[packed], g) for packed, g in zip(batches, got)}


def _loss_and_grads_on(config, batches, devices):
    """[(loss, grads)] of each of `batches` under `config` (one trainer) without a pipeline."""
    from jaxscale.rules import use_rules
    from jaxscale.train.loop import Trainer
    from jaxscale.train.step import accumulate_grads
    from jaxscale.weights.tree import flatten

    trainer = Trainer.build(config, workdir=None, devices=devices)
    ctx = trainer.ctx

    @jax.jit
    def grads(state, batch):
        with use_rules(ctx.rules, ctx.mesh):
            return accumulate_grads(state.params, state.frozen, batch, ctx.model_def,
                                    ctx.grad_accum)

    out = []
    for batch in batches:
        loss, g = jax.device_get(grads(trainer.state, trainer.to_global(batch)))
        out.append((float(loss), {k: np.asarray(v) for k, v in flatten(g).items()}))
    return out


@pytest.mark.parametrize("packed, mesh, preset, pipeline, grad_accum", [
    (True, {"fsdp": 4, "tensor": 2}, "fsdp_tp", {}, 1),
    (False, {"pipeline": 2, "data": 4}, "pp", dict(schedule="gpipe", microbatches=2), 1),
    (False, {"pipeline": 2, "data": 4}, "pp", dict(schedule="1f1b", microbatches=2), 2),
    pytest.param(True, {"pipeline": 2, "data": 4}, "pp", dict(schedule="1f1b", microbatches=2),
                 1, marks=pytest.mark.exhaustive),
    pytest.param(False, {"data": 8}, "dp", {}, 2, marks=pytest.mark.exhaustive),
])
def test_split_steps_normalise_as_one_device(reference_runs, packed, mesh, preset, pipeline,
                                             grad_accum):
    batch, (want_loss, want) = reference_runs[packed]
    config = make_config(mesh, preset, **pipeline)
    config.train.grad_accum = grad_accum
    if "pipeline" in mesh:
        loss, grads = _loss_and_grads(config, batch, True)
    else:
        (loss, grads), = _loss_and_grads_on(config, [batch], jax.devices())
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert set(grads) == set(want)
    for k in want:
        assert np.linalg.norm(grads[k] - want[k]) <= 1e-5 * np.linalg.norm(want[k]) + 1e-7, k


def test_heldout_loss_and_evaluate_count_the_assistant_tokens(tmp_path):
    from jaxscale.inference.evaluate import evaluate_workdir
    from jaxscale.observe.metrics import read_metrics
    from jaxscale.train.loop import prepare

    tok = tokenizer_dir(str(tmp_path), "qwen3_generation")
    rng = random.Random(0)
    chats = []
    for _ in range(240):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
        chats.append({"messages": [{"role": "user", "content": q},
                                   {"role": "assistant", "content": q.upper()}]})
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    c = tiny_lm.get_config("test")
    c.model.vocab_size = 512
    c.data.update(sources=f"chat={tmp_path}/chat.jsonl", tokenizer=tok, packing="pack",
                  seq_len=64, eval_fraction=0.3, eval_batches=1)
    c.train.update(steps=2, log_every=2, eval_every=2)
    c.checkpoint.every = 2
    workdir = str(tmp_path / "run")
    trainer = prepare(c, workdir)
    trainer.run()
    logged = [m for m in read_metrics(workdir) if m.get("eval_loss") is not None][-1]
    got = evaluate_workdir(workdir)
    assert abs(logged["eval_loss"] - got["loss"]) <= 1e-5
    batch = trainer.eval_data[0]
    seg, mask = batch["segment_ids"], batch["loss_mask"]
    counted = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0) & (mask[:, 1:] > 0)).sum()
    assert got["tokens"] == counted < ((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)).sum()
