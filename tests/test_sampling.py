"""The rollout sampler (issue 42 item 1): greedy equals `make_generate` on ragged prompts,
top-k=1 equals greedy, the top-k / top-p masks equal a direct numpy computation and sampled
tokens stay inside them, stop ids end rows (masked, lengths reported), log-probs equal a full
forward's, n samples per prompt, and one compiled program per (rows, bucket, new tokens)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.inference import generate as gen
from jaxscale.inference.sampling import Sampler, Sampling, bucket, filter_logits
from tests.test_generate import tiny, uncached_greedy

LENGTHS = (3, 7, 5)
STEPS = 6


@pytest.fixture(scope="module")
def model():
    return tiny()


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, n).tolist() for n in LENGTHS]


def padded(rows: list[list[int]], width: int) -> np.ndarray:
    batch = np.zeros((len(rows), width), np.int32)
    for r, p in enumerate(rows):
        batch[r, width - len(p):] = p
    return batch


def full_logits(fwd, params, prompt: list[int], new: np.ndarray) -> np.ndarray:
    """One unpadded full forward over prompt + new: the logits that chose each new token."""
    seq = np.asarray(prompt + new.tolist(), np.int32)[None]
    logits = np.asarray(fwd(params, seq))[0]
    return logits[len(prompt) - 1:-1].astype(np.float32)


def test_greedy_equals_make_generate_and_top_k_one_equals_greedy(model):
    model_def, params = model
    rows = prompts()
    out = Sampler(model_def)(params, rows, jax.random.key(0), STEPS)
    ref = gen.make_generate(model_def, STEPS)(params, padded(rows, 7), jax.random.key(0),
                                              jnp.asarray(LENGTHS))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref)[:, 7:])
    assert np.asarray(out.lengths).tolist() == [STEPS] * 3 and np.asarray(out.mask).all()
    assert not np.asarray(out.stopped).any()
    same = np.asarray([rows[0][:3], rows[1][:3]], np.int32)  # equal lengths: the plain path
    np.testing.assert_array_equal(
        np.asarray(Sampler(model_def)(params, same, jax.random.key(0), STEPS).tokens),
        uncached_greedy(model_def, params, same, STEPS)[:, 3:])
    top1 = Sampler(model_def, Sampling(temperature=1.3, top_k=1, n=2))
    np.testing.assert_array_equal(
        np.asarray(top1(params, rows, jax.random.key(5), STEPS).tokens),
        np.repeat(np.asarray(out.tokens), 2, axis=0))


def numpy_filter(logits: np.ndarray, temperature: float, top_k: int, top_p: float
                 ) -> np.ndarray:
    """The kept tokens, as transformers' warpers compute them: temperature, then top-k (the k
    largest), then top-p on what is left (sort ascending, drop while the cumulative probability
    stays <= 1 - top_p)."""
    x = logits.astype(np.float64) / temperature
    keep = np.ones_like(x, bool)
    if top_k:
        order = np.argsort(-x, axis=-1)[:, :top_k]
        keep = np.zeros_like(keep)
        np.put_along_axis(keep, order, True, axis=-1)
    if top_p < 1.0:
        y = np.where(keep, x, -np.inf)
        for r in range(len(y)):
            asc = np.argsort(y[r])
            p = np.exp(y[r][asc] - y[r].max())
            p /= p.sum()
            drop = np.cumsum(p) <= 1 - top_p
            drop[-1] = False  # the likeliest always stays
            keep[r, asc[drop]] = False
    return keep


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 5, 1.0), (0.7, 0, 0.9), (1.0, 0, 0.3), (2.0, 20, 0.8), (1.0, 1, 0.5)])
def test_filter_masks_equal_numpy(temperature, top_k, top_p):
    logits = np.random.default_rng(1).normal(0, 3, (6, 64)).astype(np.float32)
    got = np.isfinite(np.asarray(filter_logits(jnp.asarray(logits), temperature, top_k, top_p)))
    np.testing.assert_array_equal(got, numpy_filter(logits, temperature, top_k, top_p))


def test_top_k_keeps_ties_and_caps_at_the_vocabulary_as_transformers():
    """Tokens tied with the k-th likeliest stay (transformers' TopKLogitsWarper keeps every
    score not below the k-th), and k beyond the vocabulary keeps everything."""
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TopKLogitsWarper
    logits = np.array([[3.0, 2.0, 2.0, 2.0, 1.0, -1.0], [0.5, 0.5, 0.5, 0.5, 0.2, 0.1],
                       [-2.0, 7.0, -np.inf, 1.5, 1.5, 0.0]], np.float32)
    for k in (1, 2, 4, 10):
        ref = TopKLogitsWarper(k)(None, torch.from_numpy(logits.copy()))
        got = filter_logits(jnp.asarray(logits), 1.0, k)
        np.testing.assert_array_equal(np.isfinite(np.asarray(got)), torch.isfinite(ref).numpy())


def test_sampled_tokens_stay_in_the_filtered_set_and_logprobs_equal_a_full_forward(model):
    """Each sampled token is among the top-k / top-p set of the full forward's logits at its
    position, and its reported log-prob is the full forward's log-softmax."""
    model_def, params = model
    rows = prompts()
    settings = Sampling(temperature=1.0, top_k=4, top_p=0.6, n=3)
    out = Sampler(model_def, settings)(params, rows, jax.random.key(3), STEPS)
    tokens, logprobs = np.asarray(out.tokens), np.asarray(out.logprobs)
    assert tokens.shape == (9, STEPS)
    fwd = jax.jit(lambda p, t: model_def.module(p)(t))
    for r in range(9):
        prompt = rows[r // 3]
        logits = full_logits(fwd, params, prompt, tokens[r])
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
        np.testing.assert_allclose(logprobs[r], logp[np.arange(STEPS), tokens[r]], atol=2e-5)
        kept = numpy_filter(logits, 1.0, 4, 0.6)
        assert kept[np.arange(STEPS), tokens[r]].all(), r
    assert len({tuple(t) for t in tokens[:3]}) > 1  # the n samples of a prompt differ
    again = Sampler(model_def, settings)(params, rows, jax.random.key(3), STEPS)
    np.testing.assert_array_equal(np.asarray(again.tokens), tokens)


def test_stop_ids_end_rows_masked_with_lengths(model):
    model_def, params = model
    rows = prompts()
    free = np.asarray(Sampler(model_def)(params, rows, jax.random.key(0), STEPS).tokens)
    stop = int(free[0, 2])  # row 0's third token
    firsts = [next((i for i, t in enumerate(r) if t == stop), None) for r in free]
    out = Sampler(model_def, Sampling(stop_ids=(stop, 255), pad_id=0))(
        params, rows, jax.random.key(0), STEPS)
    tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
    for r, first in enumerate(firsts):
        n = STEPS if first is None else first + 1  # the stop token is kept and counted
        assert int(out.lengths[r]) == n and mask[r].sum() == n
        assert bool(out.stopped[r]) == (first is not None)
        np.testing.assert_array_equal(tokens[r, :n], free[r, :n])
        assert (tokens[r, n:] == 0).all() and (np.asarray(out.logprobs)[r, n:] == 0).all()
    assert firsts[0] == 2


def test_one_program_per_rows_bucket_and_new_tokens(model):
    model_def, params = model
    sampler = Sampler(model_def, max_len=128)
    sampler(params, [[1, 2, 3]] * 2, jax.random.key(0), 4)
    sampler(params, [[1] * 9, [2] * 12], jax.random.key(1), 4)  # the same 16-token bucket
    assert sampler.compiles() == 1 and sampler.shapes == {(2, 16, 4)}
    sampler(params, [[1] * 20, [2]], jax.random.key(1), 4)  # the 32 bucket
    assert sampler.compiles() == 2
    assert (bucket(3), bucket(17), bucket(64), bucket(100, cap=120)) == (16, 32, 64, 120)


def test_bad_settings_are_one_paragraph(model):
    model_def, params = model
    with pytest.raises(gen.GenerateError, match=r"top_k=-1 .*top_p=1.5 .*n=0"):
        Sampler(model_def, Sampling(top_k=-1, top_p=1.5, n=0))
    with pytest.raises(gen.GenerateError, match="max_len=64"):
        Sampler(model_def, max_len=64)(params, [[1] * 60], jax.random.key(0), 8)
    with pytest.raises(gen.GenerateError, match="at least one token"):
        Sampler(model_def)(params, [[1], []], jax.random.key(0), 8)


def test_sharded_sampler_equals_one_device(model):
    """On a data x fsdp x tensor mesh (parameters placed by the rules, used in place; the KV
    cache sharded by them), the rollout equals one device's: tokens exactly, log-probs to 1e-5."""
    import optax

    from configs import tiny_lm
    from jaxscale.mesh import make_mesh
    from jaxscale.rules import AxisRules
    from jaxscale.train.state import init_state

    model_def, _ = model
    c = tiny_lm.get_config("test")
    c.mesh.update(data=2, fsdp=2, tensor=2)
    mesh, rules = make_mesh(c.mesh), AxisRules.from_config(c)
    state, _ = init_state(model_def, optax.sgd(0.1), rules, mesh, seed=3)
    settings = Sampling(temperature=1.0, top_k=8, n=2)
    rows = prompts() + [[9, 8]]  # 4 prompts x 2 samples: 8 rows over data x fsdp
    sharded = Sampler(model_def, settings, rules, mesh)(state.params, rows, jax.random.key(2),
                                                        STEPS)
    single = Sampler(model_def, settings)(jax.device_get(state.params), rows,
                                          jax.random.key(2), STEPS)
    np.testing.assert_array_equal(np.asarray(sharded.tokens), np.asarray(single.tokens))
    np.testing.assert_allclose(np.asarray(sharded.logprobs), np.asarray(single.logprobs),
                               atol=1e-5)


def test_decoding_replicas_equal_one_device(model):
    """On a pure data mesh (parameters replicated) each device decodes its own rows, its own
    loop ending with its rows (`Sampler.replica_axes`): the rollout, sampling noise included,
    is one device's, with rows stopping at different steps, also for rows the mesh does not
    divide (padded); with the parameters split (fsdp), the sharded program runs instead."""
    import optax

    from configs import tiny_lm
    from jaxscale.mesh import make_mesh
    from jaxscale.rules import AxisRules
    from jaxscale.train.state import init_state

    model_def, _ = model
    c = tiny_lm.get_config("test")
    c.mesh.update(data=4, fsdp=2)
    split = make_mesh(c.mesh), AxisRules.from_config(c)
    state, _ = init_state(model_def, optax.sgd(0.1), split[1], split[0], seed=3)
    c.mesh.update(data=8, fsdp=1)
    mesh, rules = make_mesh(c.mesh), AxisRules.from_config(c)
    params = jax.device_put(jax.device_get(state.params), jax.NamedSharding(mesh, jax.P()))
    rows = prompts() + [[9, 8]]  # 4 prompts x 2 samples: one row a device
    free = Sampler(model_def, Sampling(temperature=1.0, top_k=8, n=2))(
        jax.device_get(params), rows, jax.random.key(2), STEPS)
    settings = Sampling(temperature=1.0, top_k=8, n=2, stop_ids=(int(free.tokens[0, 2]),))
    single = Sampler(model_def, settings)(jax.device_get(params), rows, jax.random.key(2), STEPS)
    assert len(set(np.asarray(single.lengths).tolist())) > 1  # rows stop at different steps
    sampler = Sampler(model_def, settings, rules, mesh)
    assert sampler.replica_axes(params) == ("data",)
    assert Sampler(model_def, settings, split[1], split[0]).replica_axes(state.params) is None
    for batch in (rows, rows[:3]):  # 8 rows; 6, padded to 8 with copies of the first
        replicas = sampler(params, batch, jax.random.key(2), STEPS)
        alone = Sampler(model_def, settings)(jax.device_get(params), batch, jax.random.key(2),
                                             STEPS)
        assert replicas.tokens.shape == alone.tokens.shape == (2 * len(batch), STEPS)
        for got, want in zip(replicas, alone):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(replicas.tokens), np.asarray(alone.tokens))
    # one replica program per row count (8 and 6), the sharded program never
    assert sampler._replicated._cache_size() == 2 and sampler._jitted._cache_size() == 0


def test_weight_copies_equal_the_weights_in_place(model):
    """By default the weights are read in place and the layers scanned over the stacked cache;
    `copy_weights` (per-call copies of each layer's weights, one cache per layer, the layers
    unrolled) samples the very same rollout. A model deeper than `unroll_layers`, and one whose
    layers a pipeline mesh splits, keep the scan."""
    model_def, params = model
    settings, rows = Sampling(temperature=1.0, top_p=0.9, n=2), prompts()
    runs = [Sampler(model_def, settings, **kw) for kw in
            [{}, {"copy_weights": True}, {"copy_weights": True, "unroll_layers": 0}]]
    outs = [s(params, rows, jax.random.key(3), STEPS) for s in runs]
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(outs[0].tokens))
        np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(outs[0].logprobs),
                                   atol=1e-6)
    greedy = lambda copy, unroll, *mesh: str(jax.make_jaxpr(
        lambda p: Sampler(model_def, Sampling(), *mesh, unroll_layers=unroll,
                          copy_weights=copy)._rollout(
            p, jnp.ones((2, 16), jnp.int32), jnp.full((2,), 16), jax.random.key(0), steps=2)
    )(params))
    assert " scan[" in greedy(False, 16) and " scan[" in greedy(True, 0)
    assert " scan[" not in greedy(True, 16)
    from configs import tiny_lm
    from jaxscale.mesh import make_mesh
    from jaxscale.rules import AxisRules

    c = tiny_lm.get_config("test")  # layers over pipeline stages: each stage scans its own
    c.mesh.update(data=2, pipeline=2, fsdp=2)
    assert " scan[" in greedy(True, 16, AxisRules.from_config(c), make_mesh(c.mesh))
