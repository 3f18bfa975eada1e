"""Context parallelism (`mesh.context`, `models/context.py`) computes what one device computes.

Attention across sequence shards, `allgather` and `ring`, equals plain einsum attention in the
forward pass and in the gradients of q, k and v (float32, grouped-query heads, packed documents
with padding, heads split over `tensor` too), and its compiled form really gathers or rotates
the keys; the zigzag order balances causal work and attention follows it. A tiny grouped-query
Llama trained three steps on `context=4 x data=2` and `context=2 x fsdp=2 x tensor=2` (and,
marked exhaustive, `context=2 x pipeline=2 x data=2`) equals one device (the helpers of
tests/test_parallel_equivalence.py). Sequence shards that attention cannot follow are
one-paragraph errors.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.tiny_lm import get_config
from jaxscale import config as config_lib
from jaxscale.errors import ConfigError
from jaxscale.mesh import make_mesh, mesh_summary
from jaxscale.models import context
from jaxscale.models.attention import attend
from jaxscale.models.mask import Mask
from jaxscale.presets import PRESETS
from jaxscale.rules import AxisRules, constrain, normalize_rules, use_rules
from jaxscale.train.loop import Trainer
from tests.test_parallel_equivalence import assert_equal_runs, make_config, run_steps

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


def _gqa_config(mesh, **pipeline):
    c = make_config(mesh, **pipeline)
    c.model.num_kv_heads = 2
    return c


@pytest.fixture(scope="module")
def one_device():
    return run_steps(_gqa_config({}), jax.devices()[:1])


@pytest.mark.parametrize("mesh, variant, order, pipeline", [
    ({"context": 4, "data": 2}, "ring", "zigzag", {}),
    ({"context": 2, "fsdp": 2, "tensor": 2}, "allgather", "natural", {}),
    pytest.param({"context": 2, "pipeline": 2, "data": 2}, "ring", "auto", dict(microbatches=2),
                 marks=pytest.mark.exhaustive),  # GPipe stages: shard_map under the stages' vmap
])
def test_llama_on_sequence_shards_equals_one_device(one_device, monkeypatch, mesh, variant,
                                                    order, pipeline):
    """The zigzag case lays every sequence in the load-balanced order (inputs, targets,
    positions and slots permuted, hidden halves skipped) and still equals one device."""
    config = _gqa_config(mesh, **pipeline)
    config.model.update(context_attention=variant, context_order=order)
    config_lib.validate(config)
    orders = []
    zigzag = context.zigzag_order
    monkeypatch.setattr(context, "zigzag_order", lambda *a: orders.append(a) or zigzag(*a))
    assert_equal_runs(run_steps(config, jax.devices()), one_device)
    shards = mesh["context"]
    assert set(orders) == ({(config.data.seq_len, shards)} if order != "natural" else set())


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
    ({"context": 2}, dict(model__attention="splash"), "model.attention='splash' does not run"),
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
    (T, "splash", "model.attention='splash' does not run across sequence shards"),
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
