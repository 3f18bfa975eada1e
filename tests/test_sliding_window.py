"""Sliding-window attention (`model.sliding_window`) and the Mistral family: the mask against a
brute-force one (packed documents too) in every kernel, splash's local mask, and a tiny random
`transformers` Mistral: logits, greedy generation past the window, round trip, conversion, and
the refusals."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxscale.errors import ConfigError
from jaxscale.inference import generate as gen
from jaxscale.interop import convert, hf, hf_mistral
from jaxscale.models import ModelDef, check_model, hf_opener
from jaxscale.models.attention.kernels import attend
from jaxscale.models.attention.mask import Mask
from jaxscale.models.attention.splash import kernel_mask
from jaxscale.precision import get_policy
from jaxscale.weights.tree import flatten
from tests.aot_common import libtpu_test, run_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.hf_common import make_tiny

WINDOW = 4
# Row 0: documents of 5, 3 and 8 tokens; row 1: padding (segment 0) then documents of 7 and 6.
SEGMENTS = np.stack([np.repeat([1, 2, 3], [5, 3, 8]), np.repeat([0, 1, 2], [3, 7, 6])])


def brute_force(q_slots, k_slots, window, segments_q=None, segments_k=None):
    """(B, T, S) by loops: a query sees a key of its own document (segments) whose position in
    that document is at most its own and within `window` of it (0: no window)."""
    b = 1 if segments_q is None else len(segments_q)
    out = np.zeros((b, len(q_slots), len(k_slots)), bool)
    for r, i, j in np.ndindex(out.shape):
        qs, ks = q_slots[i], k_slots[j]
        if segments_q is None:
            back = qs - ks
        elif segments_q[r][i] != segments_k[r][ks]:
            continue
        else:  # positions within the document: slots counted from the document's first
            first = list(segments_k[r]).index(segments_k[r][ks])
            back = (qs - first) - (ks - first)
        out[r, i, j] = 0 <= back and (window == 0 or back < window)
    return out


@pytest.mark.parametrize("window", [0, 1, WINDOW, 100])
def test_dense_masks_equal_brute_force_with_packing_and_cache(window):
    t = SEGMENTS.shape[1]
    slots = list(range(t))
    got = Mask.sequence(t, jnp.asarray(SEGMENTS), window=window).dense()
    np.testing.assert_array_equal(got, brute_force(slots, slots, window, SEGMENTS, SEGMENTS))
    got = Mask.sequence(t, window=window).dense()
    np.testing.assert_array_equal(got, brute_force(slots, slots, window))
    # 3 new queries at slots 9..11 over a 16-slot cache (slots past 11 not yet written).
    segs = jnp.asarray(SEGMENTS)
    got = Mask.cached(3, jnp.int32(9), t, segs[:, 9:12], segs, window=window).dense()
    np.testing.assert_array_equal(got, brute_force([9, 10, 11], slots, window, SEGMENTS[:, 9:12],
                                                   SEGMENTS))
    got = Mask.cached(3, jnp.int32(9), t, window=window).dense()
    np.testing.assert_array_equal(got, brute_force([9, 10, 11], slots, window))


@pytest.mark.parametrize("window", [1, 3, 6])
def test_splash_kernel_mask_is_the_window(window):
    """The splash kernel's own mask object (a `LocalMask`, whose tiles outside the band the
    kernel skips) marks exactly the keys of the dense mask."""
    got = kernel_mask((16, 16), causal=True, window=window)
    assert type(got).__name__ == "LocalMask"
    np.testing.assert_array_equal(got[:, :], brute_force(range(16), range(16), window)[0])
    assert type(kernel_mask((16, 16), causal=True)).__name__ == "CausalMask"


@pytest.mark.filterwarnings("ignore:model.attention=splash")
@pytest.mark.parametrize("segments", [False, True], ids=["plain", "packed"])
def test_every_kernel_applies_the_window(segments):
    """einsum, the fused kernel (its `local_window_size` when unpacked) and splash (its local
    mask with segment ids, Pallas interpret mode here) compute the same windowed attention,
    which differs from full causal attention."""
    t = 256
    rng = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(rng[0], (2, t, 4, 32))
    k, v = (jax.random.normal(r, (2, t, 2, 32)) for r in rng[1:])
    segs = jnp.asarray(np.stack([np.repeat([1, 2], [100, 156]), np.repeat([0, 1], [60, 196])]))
    mask = Mask.sequence(t, segs if segments else None, window=40)
    ref = attend(q, k, v, mask, impl="einsum")
    for impl in ("dot_product_attention", "splash"):
        np.testing.assert_allclose(attend(q, k, v, mask, impl=impl), ref, atol=2e-5, rtol=2e-5,
                                   err_msg=impl)
    full = attend(q, k, v, Mask.sequence(t, segs if segments else None), impl="einsum")
    assert np.max(np.abs(full - ref)) > 0.1


def test_packed_documents_see_their_own_window():
    """Packed rows: each document's logits equal those of the document alone (the window
    counts positions inside the document, never reaching into the previous one)."""
    from configs import tiny_lm
    c = tiny_lm.get_config("test")
    c.model.update(sliding_window=3, num_layers=1)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(1))
    fwd = jax.jit(lambda p, t, pos, s: model_def.module(p)(t, pos, segments_BT=s))
    plain = jax.jit(lambda p, t: model_def.module(p)(t))
    lengths = (7, 9)
    tokens = np.random.default_rng(0).integers(0, 256, (1, sum(lengths))).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32)
    segments = np.repeat([1, 2], lengths)[None].astype(np.int32)
    packed = np.asarray(fwd(params, tokens, positions, segments))
    start = 0
    for n in lengths:
        alone = plain(params, tokens[:, start:start + n])
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=1e-5, rtol=1e-5)
        start += n


# ----------------------------------------------------------------------------- transformers
@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny random MistralForCausalLM (explicit head_dim, window 4) and its directory."""
    path = str(tmp_path_factory.mktemp("hf") / "mistral")
    model = make_tiny(transformers.MistralForCausalLM, transformers.MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
        sliding_window=WINDOW, rope_theta=20000.0, bos_token_id=None, eos_token_id=None,
        pad_token_id=0), path, noise=0.1)  # non-trivial norm scales: a swapped norm shows
    return model, path


@pytest.fixture(scope="module")
def loaded(mistral):
    model_cfg, params = hf_mistral.load_mistral(mistral[1])
    return model_cfg, params, ModelDef.build(model_cfg, get_policy("32-true"))


def test_config_is_read_and_logits_match_transformers(mistral, loaded):
    model, _ = mistral
    model_cfg, params, model_def = loaded
    assert (model_cfg["name"], model_cfg["sliding_window"], model_cfg["head_dim"]) == (
        "mistral", WINDOW, 16)
    tokens = np.random.default_rng(0).integers(0, 96, (2, 24)).astype(np.int32)  # 6 windows
    with torch.no_grad():
        ref = model(torch.from_numpy(tokens).long()).logits.numpy()
    fwd = lambda d: np.asarray(jax.jit(lambda p, t: d.module(p)(t))(params, tokens))
    err = np.max(np.abs(fwd(model_def) - ref))
    assert err < 1e-4
    full = ModelDef.build(dict(model_cfg, sliding_window=0), get_policy("32-true"))
    assert np.max(np.abs(fwd(full) - ref)) > 100 * err  # the window is applied and matters


def test_greedy_generation_past_the_window_equals_transformers(mistral, loaded):
    """32 greedy tokens after a 6-token prompt (the window is 4) through the KV cache, equal
    to `generate` (its sliding-window cache keeps the window - 1 latest keys, exact); also
    left-padded prompts of different lengths, each row as its prompt would decode alone."""
    model, _ = mistral
    model_cfg, params, model_def = loaded
    prompt = np.random.default_rng(1).integers(1, 96, (2, 6)).astype(np.int32)
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=32,
                             do_sample=False, attention_mask=torch.ones(2, 6, dtype=torch.long))
    got = gen.make_generate(model_def, 32)(params, prompt, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got), ref.numpy())
    lengths = np.array([6, 3], np.int32)
    padded = np.where(np.arange(6)[None] >= 6 - lengths[:, None], prompt, 0).astype(np.int32)
    got = gen.make_generate(model_def, 32)(params, padded, jax.random.key(0), lengths)
    alone = model.generate(torch.from_numpy(prompt[1:, -3:]).long(), max_new_tokens=32,
                           do_sample=False, attention_mask=torch.ones(1, 3, dtype=torch.long))
    np.testing.assert_array_equal(np.asarray(got)[0], ref.numpy()[0])
    np.testing.assert_array_equal(np.asarray(got)[1, 3:], alone.numpy()[0])


def test_import_export_import_is_bit_exact_and_loads_in_transformers(mistral, loaded, tmp_path):
    model, path = mistral
    model_cfg, params, _ = loaded
    out = hf_mistral.save_mistral((model_cfg, params), str(tmp_path / "export"))
    written = json.load(open(os.path.join(out, "config.json")))
    assert (written["model_type"], written["sliding_window"]) == ("mistral", WINDOW)
    assert written["architectures"] == ["MistralForCausalLM"]
    again_cfg, again = hf_mistral.load_mistral(out)
    assert again_cfg == model_cfg
    for k, v in flatten(params).items():
        np.testing.assert_array_equal(flatten(again)[k], v)
    exported, original = hf.SafetensorsReader(out), model.state_dict()
    for k in exported.keys():
        np.testing.assert_array_equal(exported.get(k), original[k].numpy())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "MistralForCausalLM"
    tokens = torch.arange(20).reshape(1, 20)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(),
                                      model(tokens).logits.numpy())


def test_convert_from_and_to_hf_dispatch_on_mistral(mistral, loaded, tmp_path):
    """`launch.convert --from_hf` / `--to_hf`: the table's `mistral` entry serves both ways."""
    _, path = mistral
    model_cfg, params, _ = loaded
    assert hf_opener(hf.read_hf_config(path), path) is hf_mistral.open_mistral
    written = convert.hf_to_workdir(path, str(tmp_path / "converted"))
    assert written == model_cfg
    assert written["sliding_window"] == 4  # what init_from's run takes
    out = convert.workdir_to_hf(str(tmp_path / "converted"), str(tmp_path / "back"))
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == "mistral"
    for k, v in flatten(hf_mistral.load_mistral(out).params).items():
        np.testing.assert_array_equal(v, flatten(params)[k])


@pytest.mark.parametrize("change, culprit", [
    (dict(sliding_window=-2), "sliding_window=-2 is not a positive integer"),
    (dict(sliding_window=2.5), "sliding_window=2.5"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types mixes"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "gelu"),
])
def test_unsupported_mistral_configs_are_refused(mistral, tmp_path, change, culprit):
    cfg = json.load(open(os.path.join(mistral[1], "config.json")))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(hf.ConversionError, match=culprit):
        hf_mistral.open_mistral(str(tmp_path))


def test_null_window_is_full_attention_and_a_windowed_llama_is_not_exported(loaded, tmp_path):
    model_cfg, params, _ = loaded
    assert hf_mistral.mistral_config_from_hf(
        {**hf_mistral.mistral_config_to_hf(model_cfg), "sliding_window": None})[
            "sliding_window"] == 0
    with pytest.raises(hf.ConversionError, match="model.sliding_window=4.*model.name=mistral"):
        hf.save_llama((dict(model_cfg, name="llama"), params), str(tmp_path / "llama"))


@pytest.mark.parametrize("window", [-1, 2.5, True, "4"])
def test_bad_sliding_window_is_one_paragraph(window):
    from configs import tiny_lm
    c = tiny_lm.get_config("test")
    with pytest.raises(ConfigError, match=f"model.sliding_window={window!r} must be a "
                                          "non-negative integer"):
        check_model({**c.model.to_dict(), "sliding_window": window}, 16)
    check_model({**c.model.to_dict(), "sliding_window": None}, 16)  # None: full, as 0


@libtpu_test
@pytest.mark.exhaustive
def test_windowed_splash_lowers_for_tpu(tmp_path):
    """`launch.compile` lowers the splash kernel with its local mask for a TPU topology (Mosaic):
    the kernel runs (fwd, the remat's fwd again, dq, dkv per layer), not an einsum fallback."""
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5p:2x2x1", "--config=configs/llama.py:1b",
                       "--config.model.num_layers=2", "--config.data.batch_size=4",
                       "--config.mesh.fsdp=4", "--config.model.attention=splash",
                       "--config.model.sliding_window=512", f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())["kernel_calls"] == 4 * 2
