"""`model.loss_chunks`: the LM head and loss computed chunk by chunk give the loss and
gradients of the whole-sequence head (plain and packed rows, sharded, under GPipe and inside
the 1F1B schedule), and
the chunked step really holds only a chunk of logits at a time."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny_lm
from jaxscale import config as config_lib
from jaxscale.errors import ConfigError
from jaxscale.models import ModelDef
from jaxscale.models.decoder import lm_task
from jaxscale.models.decoder.lm_task import choose_loss_chunks, lm_loss
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer
from tests.helpers import run_steps

RNG = np.random.default_rng(7)
TOKENS = RNG.integers(0, 256, (4, 65)).astype(np.int32)
# Packed rows: documents of 20 / 30 / 15 tokens, then one of 40 followed by padding (segment 0).
SEGMENTS = np.stack([np.repeat([1, 2, 3], [20, 30, 15]), np.repeat([1, 0], [40, 25])] * 2)
POSITIONS = np.stack([np.concatenate([np.arange(n) for n in (20, 30, 15)]),
                      np.concatenate([np.arange(40), np.zeros(25, int)])] * 2)


def _loss_and_grads(chunks: int, batch: dict) -> tuple[jax.Array, dict]:
    c = tiny_lm.get_config("test")
    c.model.update(loss_chunks=chunks, vocab_size=256)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(3))
    loss = lambda p: lm_loss(model_def.module(p), batch)
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("chunks, packed", [
    (4, True), (64, False),
    pytest.param(4, False, marks=pytest.mark.exhaustive), pytest.param(64, True, marks=pytest.mark.exhaustive)])
def test_chunked_loss_and_gradients_equal_the_whole_sequence(chunks, packed):
    batch = {"tokens": TOKENS}
    if packed:
        batch.update(segment_ids=SEGMENTS.astype(np.int32), positions=POSITIONS.astype(np.int32))
    (loss, grads), (want, want_grads) = _loss_and_grads(chunks, batch), _loss_and_grads(1, batch)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    chex.assert_trees_all_close(grads, want_grads, atol=1e-6, rtol=1e-5)


def test_chunked_step_holds_a_chunk_of_logits_not_the_whole_sequence():
    """The compiled step's temporaries shrink by about the float32 logits and their gradient."""
    def temp_bytes(chunks: int) -> int:
        c = tiny_lm.get_config("test")
        c.model.update(loss_chunks=chunks, vocab_size=8192, embed=64, mlp=128, num_layers=1)
        model_def = ModelDef.build(c.model, get_policy("bf16-mixed"))
        params = model_def.init_params(jax.random.key(0))
        tokens = jnp.zeros((8, 513), jnp.int32)
        grad = jax.jit(jax.grad(lambda p, t: lm_loss(model_def.module(p), {"tokens": t})))
        return grad.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    logits = 8 * 512 * 8192 * 4  # (B, T, V) float32: 128 MiB
    whole, chunked = temp_bytes(1), temp_bytes(16)
    assert whole > 2 * logits  # the logits and their gradient
    assert chunked < whole - 1.5 * logits, (whole, chunked)


def _losses(mesh: dict, preset: str, chunks: int, **train) -> np.ndarray:
    c = tiny_lm.get_config("test")
    c.model.update(loss_chunks=chunks)
    c.data.update(seq_len=64, batch_size=8)
    c.mesh.update({**dict(data=1, pipeline=1, fsdp=1, tensor=1), **mesh})
    c.rules_preset = preset
    for key, value in train.items():
        (c.pipeline if key in ("microbatches", "schedule") else c.train)[key] = value
    return run_steps(Trainer.build(c, workdir=None), 2)[0]


@pytest.mark.parametrize("mesh, preset, train", [
    (dict(fsdp=4, tensor=2), "fsdp_tp", {}),                         # vocab over `tensor`
    pytest.param(dict(pipeline=2, data=2, tensor=2), "pp", dict(microbatches=2),  # GPipe
                 marks=pytest.mark.exhaustive),
    (dict(pipeline=2, data=2, tensor=2), "pp", dict(microbatches=4, schedule="1f1b")),  # fused
])
def test_sharded_training_with_chunks_equals_without(mesh, preset, train):
    np.testing.assert_allclose(_losses(mesh, preset, 8, **train),
                               _losses(mesh, preset, 1, **train), rtol=1e-5)


@pytest.mark.parametrize("chunks", [-1, 3])
def test_loss_chunks_must_divide_the_sequence(chunks):
    c = tiny_lm.get_config("test")
    c.data.seq_len, c.model.loss_chunks = 64, chunks
    with pytest.raises(ConfigError, match=r"model.loss_chunks=.* must be 0 \(automatic\) or a "
                                          r"positive divisor of data.seq_len \(64\)"):
        config_lib.validate(c)


def test_automatic_chunks_are_the_fewest_divisors_under_the_budget():
    gib = 1 << 30
    seven_b = 64 * 2048 * 32000 * 4  # float32 logits of 64 x 2,048 tokens, 32k vocabulary
    assert choose_loss_chunks(2048, seven_b) == 16 and choose_loss_chunks(2048, seven_b / 2) == 8
    assert choose_loss_chunks(2048, 4 * 2048 * 32000 * 4) == 1  # 0.98 GiB: whole
    assert choose_loss_chunks(96, 5 * gib) == 6  # 5 is no divisor of 96: the next one
    assert choose_loss_chunks(96, 5 * gib, length_shards=32) == 3  # 32 | 96/n: n in (1, 3)
    for positions in (1, 7, 96, 1000):  # always a divisor, even where no divisor fits
        for length_shards in (1, 2, 3):
            n = choose_loss_chunks(positions, 1e12, length_shards)
            assert positions % n == 0, (positions, length_shards, n)


def test_automatic_chunks_follow_the_budget_and_keep_the_loss(monkeypatch):
    """`loss_chunks=0` chunks where a chip's logits exceed `LOGITS_BUDGET`, with the whole
    sequence's loss and gradients (packed rows)."""
    batch = {"tokens": TOKENS, "segment_ids": SEGMENTS.astype(np.int32),
             "positions": POSITIONS.astype(np.int32)}
    chosen = []
    monkeypatch.setattr(lm_task, "LOGITS_BUDGET", 4 * 64 * 256 * 4 / 16)  # a 16th of the logits
    real = lm_task.choose_loss_chunks
    monkeypatch.setattr(lm_task, "choose_loss_chunks", lambda *a: chosen.append(real(*a)) or
                        chosen[-1])
    (loss, grads), (want, want_grads) = _loss_and_grads(0, batch), _loss_and_grads(1, batch)
    assert chosen == [16]
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    chex.assert_trees_all_close(grads, want_grads, atol=1e-6, rtol=1e-5)


def test_the_chunk_loop_moves_no_head_sized_collective():
    """The head weight is gathered, and its gradient reduced, once per step, not per chunk: in
    the compiled (XLA:CPU, fsdp=8) step no collective inside a loop moves as much as a shard
    of the head weight (the layers' own FSDP gathers are smaller here)."""
    from jaxscale.aot import hlo
    from jaxscale.mesh import make_mesh
    from jaxscale.train.build import batch_spec, build_step

    c = tiny_lm.get_config("test")
    c.model.update(loss_chunks=8, vocab_size=8192)
    c.data.update(seq_len=64, batch_size=8)
    c.mesh.update(data=1, pipeline=1, fsdp=8, tensor=1)
    c.rules_preset = "fsdp"
    text = build_step(c, make_mesh(c.mesh, jax.devices())).lower(batch_spec(c)).compile().as_text()
    head_shard = c.model.embed * c.model.vocab_size * 4 // 8
    looped = [x for x in hlo.collectives(text) if x.in_loop and x.bytes >= head_shard]
    assert not looped, looped
    assert any(x.bytes >= head_shard for x in hlo.collectives(text))  # gathered, once
