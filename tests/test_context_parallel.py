"""Context parallelism (`mesh.context`, `models/attention/sequence/context.py`) computes what one device computes.

Attention across sequence shards, `allgather` and `ring`, equals plain einsum attention in the
forward pass and in the gradients of q, k and v (float32, grouped-query heads, packed documents
with padding, heads split over `tensor` too), and its compiled form really gathers or rotates
the keys; the zigzag order balances causal work and attention follows it. A tiny grouped-query
Llama trained three steps on packed documents under a sliding window equals one device (the
helpers of tests/test_parallel_equivalence.py) on `context=4 x data=2` (ring, zigzag) and
`context=2 x fsdp=2 x tensor=2` (allgather); marked exhaustive, each mesh with the other
variants, `context=2 x pipeline=2 x data=2` under GPipe and 1F1B, and unpacked rows. A model of
the context mesh evaluates and generates as on one device. Sequence shards that attention
cannot follow are one-paragraph errors.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.tiny_lm import get_config
from jaxscale import config as config_lib
from jaxscale.data.mixture import files_data
from jaxscale.data.registry import heldout_batches
from jaxscale.errors import ConfigError
from jaxscale.inference.evaluate import evaluate_params
from jaxscale.inference.generate import generate_from_config, make_generate
from jaxscale.mesh import make_mesh, mesh_summary
from jaxscale.models import ModelDef
from jaxscale.models.attention.kernels import attend
from jaxscale.models.attention.mask import Mask
from jaxscale.models.attention.sequence import context
from jaxscale.models.decoder.lm_task import lm_loss
from jaxscale.precision import get_policy
from jaxscale.rules import PRESETS, AxisRules, constrain, normalize_rules, use_rules
from jaxscale.train.loop import Trainer
from tests.test_parallel_equivalence import STEPS, assert_equal_runs, make_config, run_steps

B, T, H, K, D = 2, 16, 4, 2, 8  # grouped-query: 2 query heads per kv head
RULES = AxisRules(normalize_rules(PRESETS["fsdp_tp"]))
# Row 0 packs two documents and ends in padding (segment 0); row 1 is one document.
SEGMENTS = np.array([[1] * 5 + [2] * 9 + [0] * 2, [1] * T], np.int32)


def _qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (B, T, H, D)), jax.random.normal(keys[1], (B, T, K, D)),
            jax.random.normal(keys[2], (B, T, K, D)))


def _attention(mesh, variant, window=0, softcap=0.0):
    """(q, k, v) -> sum(sin(attention)) with the sequence split over `mesh` (None: plain)."""
    def loss(q_BTHD, k_BTKD, v_BTKD):
        mask = Mask.sequence(T, jnp.asarray(SEGMENTS), window=window)
        if mesh is None:
            return jnp.sum(jnp.sin(attend(q_BTHD, k_BTKD, v_BTKD, mask, softcap=softcap)))
        with use_rules(RULES, mesh):
            q_BTHD = constrain(q_BTHD, "batch", "length", "heads", "head_dim")
            k_BTKD = constrain(k_BTKD, "batch", "length", "kv", "head_dim")
            v_BTKD = constrain(v_BTKD, "batch", "length", "kv", "head_dim")
            out_BTHD = attend(q_BTHD, k_BTKD, v_BTKD, mask, context_impl=variant,
                              softcap=softcap)
        return jnp.sum(jnp.sin(out_BTHD))
    return loss


@pytest.fixture(scope="module")
def plain():
    """Plain attention's loss and gradients on one device."""
    return jax.jit(jax.value_and_grad(_attention(None, None), argnums=(0, 1, 2)))(*_qkv())


@pytest.mark.parametrize("variant, collective, mesh", [
    (variant, collective, mesh)
    for variant, collective in [("allgather", "all_gather"), ("ring", "collective_permute")]
    for mesh in ({"context": 4, "data": 2}, {"context": 2, "tensor": 2, "fsdp": 2})] + [
    ("ring_vjp", "collective_permute", {"context": 4, "data": 2})])  # custom VJP: ring backward
def test_attention_across_shards_equals_plain(plain, variant, collective, mesh):
    fn = jax.jit(jax.value_and_grad(_attention(make_mesh(mesh), variant), argnums=(0, 1, 2)))
    assert collective in fn.lower(*_qkv()).as_text()  # the keys really travel between shards
    (loss, grads), (ref_loss, ref_grads) = fn(*_qkv()), plain
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=f"d loss / d {name}")


@pytest.mark.parametrize("variant", ["allgather", "ring", "ring_vjp"])
@pytest.mark.parametrize("option", [dict(window=5), dict(softcap=0.5)])
def test_a_sliding_window_or_softcap_across_shards_equals_plain(variant, option):
    """A window shorter than a shard (5 of 16 over 4 shards): keys from the previous shard
    only, and inside each packed document (Mistral's `model.sliding_window`). Soft-capped
    scores (Gemma 2's `attn_softcap`, a cap that bites: the scores here exceed it)."""
    grad = lambda mesh: jax.jit(jax.value_and_grad(
        _attention(mesh, variant, **option), argnums=(0, 1, 2)))(*_qkv())
    (loss, grads), (ref_loss, ref_grads) = grad(make_mesh({"context": 4, "data": 2})), grad(None)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert not np.allclose(loss, plain_loss := _attention(None, None)(*_qkv()), rtol=1e-3), (
        plain_loss)  # the option changes what is attended to
    for name, g, r in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5, err_msg=f"d loss / d {name}")


def _gqa_config(mesh, sources="", **pipeline):
    """The equivalence tests' Llama with grouped-query heads; with `sources`, trained on packed
    documents (`data.packing='pack'`: segment ids, positions restarting per document) under a
    sliding window of WINDOW tokens."""
    c = make_config(mesh, **pipeline)
    c.model.num_kv_heads = 2
    if sources:
        c.data.update(sources=sources, packing="pack", eval_fraction=0.2)
        c.model.sliding_window = WINDOW
    return c


WINDOW = 6  # shorter than a shard of the 32-token rows (8 at context=4) and every document
WORDS = "the quick brown fox jumps over lazy dog".split()


@pytest.fixture(scope="module")
def packed_sources(tmp_path_factory) -> str:
    """300 documents of 2 or 3 words (7 to 17 bytes + EOS, each longer than WINDOW): first-fit
    packs 2 or 3 of them into every 33-token row."""
    rng = np.random.default_rng(0)
    docs = [" ".join(rng.choice(WORDS, rng.integers(2, 4))) for _ in range(300)]
    path = tmp_path_factory.mktemp("packed") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return f"jsonl={path}"


@pytest.fixture(scope="module")
def one_device():
    return run_steps(_gqa_config({}), jax.devices()[:1])


@pytest.fixture(scope="module")
def one_device_packed(packed_sources):
    """The one-device run every packed, windowed mesh below is compared with."""
    return run_steps(_gqa_config({}, packed_sources), jax.devices()[:1])


def test_the_packed_reference_packs_documents_and_its_window_bites(packed_sources):
    """What the packed cases prove is only worth as much as their data: every row of the three
    batches holds several documents, and the window changes the loss of the first batch."""
    config = _gqa_config({}, packed_sources)
    batches = files_data(config, 0, 1)[0].iterator()
    rows = [next(batches) for _ in range(STEPS)]
    assert all((b["segment_ids"].max(axis=1) >= 2).all() for b in rows)
    config.model.num_layers = 1  # one layer shows it as well as four, compiled faster
    model_def = ModelDef.build(config.model, get_policy(config.precision))
    params = model_def.init_params(jax.random.key(0))
    windowed = jax.jit(lambda p, b: lm_loss(model_def.module(p), b))(params, rows[0])
    config.model.sliding_window = 0
    plain_def = ModelDef.build(config.model, get_policy(config.precision))
    whole = jax.jit(lambda p, b: lm_loss(plain_def.module(p), b))(params, rows[0])
    assert abs(float(windowed) - float(whole)) > 1e-4, (windowed, whole)


_PACKED_MESHES = [({"context": 4, "data": 2}, {}), ({"context": 2, "fsdp": 2, "tensor": 2}, {}),
                  ({"context": 2, "pipeline": 2, "data": 2}, dict(microbatches=2)),
                  ({"context": 2, "pipeline": 2, "data": 2},
                   dict(microbatches=2, schedule="1f1b"))]
# In the default suite one case per mesh without stages, the variants alternating: the ring in
# the zigzag order on context=4 x data=2, allgather on context=2 x fsdp=2 x tensor=2. The rest
# (the other variant on each, ring_vjp, GPipe and 1F1B stages) is exhaustive.
_DEFAULT = {(0, "ring"), (1, "allgather")}


@pytest.mark.parametrize("m, variant", [
    pytest.param(m, variant, marks=() if (m, variant) in _DEFAULT else pytest.mark.exhaustive,
                 id=f"{'x'.join(f'{k}{v}' for k, v in mesh.items())}"
                    f"{'-' + pipeline.get('schedule', 'gpipe') if pipeline else ''}-{variant}")
    for m, (mesh, pipeline) in enumerate(_PACKED_MESHES)
    for variant in ("ring", "allgather", "ring_vjp") if variant != "ring_vjp" or m == 0])
def test_llama_on_packed_documents_with_a_window_equals_one_device(one_device_packed,
                                                                   packed_sources, monkeypatch,
                                                                   m, variant):
    """Packed rows and a sliding window in the training step on sequence shards: the segment
    ids travel with the keys, the window reaches into the previous shard, and under the
    rings' `auto` order (zigzag) inputs, targets, positions and segment ids are permuted alike."""
    mesh, pipeline = _PACKED_MESHES[m]
    config = _gqa_config(mesh, packed_sources, **pipeline)
    config.model.context_attention = variant
    config_lib.validate(config)
    orders, zigzag = [], context.zigzag_order
    monkeypatch.setattr(context, "zigzag_order", lambda *a: orders.append(a) or zigzag(*a))
    assert_equal_runs(run_steps(config, jax.devices()), one_device_packed)
    zigzagged = {(config.data.seq_len, mesh["context"])} if variant != "allgather" else set()
    assert set(orders) == zigzagged


@pytest.mark.exhaustive  # the packed cases above run the same steps with more in them
@pytest.mark.parametrize("mesh, variant, order, pipeline", [
    ({"context": 4, "data": 2}, "ring", "zigzag", {}),
    ({"context": 2, "fsdp": 2, "tensor": 2}, "allgather", "natural", {}),
    ({"context": 2, "pipeline": 2, "data": 2}, "ring", "auto", dict(microbatches=2)),
])
def test_llama_on_sequence_shards_equals_one_device(one_device, monkeypatch, mesh, variant,
                                                    order, pipeline):
    """Unpacked rows (the stdlib stream). The zigzag case lays every sequence in the
    load-balanced order (inputs, targets, positions and slots permuted, hidden halves skipped)
    and still equals one device."""
    config = _gqa_config(mesh, **pipeline)
    config.model.update(context_attention=variant, context_order=order)
    config_lib.validate(config)
    orders = []
    zigzag = context.zigzag_order
    monkeypatch.setattr(context, "zigzag_order", lambda *a: orders.append(a) or zigzag(*a))
    assert_equal_runs(run_steps(config, jax.devices()), one_device)
    shards = mesh["context"]
    assert set(orders) == ({(config.data.seq_len, shards)} if order != "natural" else set())


def test_a_model_of_sequence_shards_evaluates_and_generates_as_on_one_device(packed_sources,
                                                                            monkeypatch):
    """Weights trained on sequence shards are ordinary weights (the mesh shards activations,
    not parameters' meaning), so a workdir's config, context mesh included, serves evaluation
    and generation. Evaluation splits the held-out sequences as training does (the ring runs)
    and equals one device; generation (prefill of an odd-length prompt, then the KV cache one
    token at a time, both masked by cache slots, not whole-sequence attention) gives the
    one-device tokens."""
    config = _gqa_config({"context": 4, "data": 2}, packed_sources)
    config.model.context_attention = "ring"
    model_def = ModelDef.build(config.model, get_policy(config.precision))
    params = jax.device_get(model_def.init_params(jax.random.key(3)))
    variants, across = [], context.attention
    monkeypatch.setattr(context, "attention",
                        lambda *a, **k: variants.append(k["variant"]) or across(*a, **k))
    got = evaluate_params(config, params)
    assert variants and set(variants) == {"ring"}  # held-out sequences split like training's
    sums = jax.jit(lambda p, b: model_def.task.eval_sums(model_def.module(p), b))
    totals = [jax.device_get(sums(params, b)) for b in heldout_batches(config, 0, 1)]
    count = sum(float(t["count"]) for t in totals)
    assert got["tokens"] == count > 0
    np.testing.assert_allclose(got["loss"], sum(float(t["loss"]) for t in totals) / count,
                               rtol=1e-5)
    prompt = np.asarray(heldout_batches(config, 0, 1)[0]["tokens"][:2, :7])
    want = make_generate(model_def, 6)(params, jnp.asarray(prompt), jax.random.key(0))
    np.testing.assert_array_equal(generate_from_config(config, params, prompt, 6), want)


def test_train_step_rotates_keys_and_mesh_names_context():
    """The train step's attention runs on shards (the ring's permutes are in its program), and
    the mesh line names the context axis."""
    config = _gqa_config({"context": 4, "data": 2})
    config.model.context_attention = "ring"
    trainer = Trainer.build(config, workdir=None)
    batch = trainer.to_global(next(trainer.batches.iterator()))
    assert "collective_permute" in trainer.train_fn.lower(trainer.state, batch).as_text()
    assert mesh_summary(trainer.ctx.mesh).startswith("data=2 pipeline=1 fsdp=1 tensor=1 context=4")


@pytest.mark.parametrize("mesh, fields, culprit", [
    ({"context": 4}, dict(data__seq_len=30), "data.seq_len=30 is not divisible by the 4"),
    ({"context": 2, "dcn_context": 2}, dict(data__seq_len=30), "(mesh.context x mesh.dcn_context)"),
    ({"context": 2}, dict(model__attention="dot_product_attention"),
     "model.attention='dot_product_attention' does not run"),
    ({}, dict(model__context_attention="zigzag"), "model.context_attention='zigzag' is not"),
    ({"context": 2}, dict(config__rules=[("batch", "data")]), "mesh axis 'context' has size 2"),
])
def test_config_errors(mesh, fields, culprit):
    c = get_config("test")
    c.mesh.update(data=1, **mesh)
    for key, value in fields.items():
        section, name = key.split("__")
        (c if section == "config" else c[section])[name] = value
    with pytest.raises(ConfigError, match=re.escape(culprit)):
        config_lib.validate(c)


@pytest.mark.parametrize("length, impl, culprit", [
    (T - 2, "einsum", "sequence length 14 is not divisible by the 4 sequence shards"),
    (T, "dot_product_attention",
     "model.attention='dot_product_attention' does not run across sequence shards"),
])
def test_attention_refuses_what_shards_cannot_run(length, impl, culprit):
    """Under rules that split the sequence (a model called outside `config.validate`), the
    attention call itself names the problem instead of silently repeating work."""
    q_BTHD, k_BTKD, v_BTKD = (x[:, :length] for x in _qkv())
    with use_rules(RULES, make_mesh({"context": 4, "data": 2})):
        with pytest.raises(ConfigError, match=culprit):
            attend(q_BTHD, k_BTKD, v_BTKD, Mask.sequence(length), impl=impl)


def test_zigzag_order_balances_causal_work_and_attention_follows_it():
    """In the zigzag order each of 4 shards has the same causal work (in order: 10 to 58), and
    ring attention over permuted queries, keys, slots and segment ids is the permuted plain
    attention: the slots that travel with the keys carry the causal mask in any order."""
    order = context.zigzag_order(T, 4)
    assert sorted(order) == list(range(T))
    assert list(context.causal_work(order, 4)) == [34] * 4
    assert list(context.causal_work(np.arange(T), 4)) == [10, 26, 42, 58]  # the last shard's burden
    q_BTHD, k_BTKD, v_BTKD = _qkv()
    plain = attend(q_BTHD, k_BTKD, v_BTKD, Mask.sequence(T, jnp.asarray(SEGMENTS)))
    slots_1T, segments_BT = jnp.asarray(order)[None], jnp.asarray(SEGMENTS[:, order])
    mask = Mask(slots_1T, slots_1T, segments_BT, segments_BT, causal=True, aligned=True)
    with use_rules(RULES, make_mesh({"context": 4, "data": 2})):
        out = jax.jit(lambda q, k, v: attend(q, k, v, mask, context_impl="ring"))(
            q_BTHD[:, order], k_BTKD[:, order], v_BTKD[:, order])
    np.testing.assert_allclose(out, plain[:, order], rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="not divisible by 8"):
        context.zigzag_order(12, 4)
