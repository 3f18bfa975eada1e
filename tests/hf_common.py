"""Shared by the Hugging Face decoder-family parity tests (Qwen, Gemma, Mistral, the MoE
families): a tiny random `transformers` model saved with non-trivial weights, jaxscale's logits,
the greedy-generation and import -> export -> import checks, and an edited config.json copy.

Each family's test builds its tiny model once (a module-scoped fixture) and runs these checks
on it, so a new family's parity test is its HF config and a few lines."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.inference import generate as gen
from jaxscale.interop import convert, hf
from jaxscale.models import ModelDef
from jaxscale.precision import get_policy
from jaxscale.weights.sources import open_huggingface
from jaxscale.weights.tree import flatten

PROMPT, NEW = 6, 32  # greedy generation: prompt length, new tokens


def make_tiny(model_cls, config, path: str, noise: float = 0.2, noisy=("norm",),
              scaled=(), factor: float = 10.0):
    """A `model_cls(config)` (seed 0, eval mode) saved to `path`: parameters whose name holds
    one of `noisy` get `noise` x randn added (norm scales start at a constant, biases at 0, so
    a dropped or misplaced one would not show), those holding one of `scaled` are multiplied by
    `factor` (e.g. q/k, for scores large enough that a soft-cap bites)."""
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if any(s in n for s in noisy):
                p.add_(noise * torch.randn_like(p))
            if any(s in n for s in scaled):
                p.mul_(factor)
    model.save_pretrained(path, safe_serialization=True)
    return model


def load(path: str) -> hf.Pretrained:
    """`Pretrained(config, host params)` of a HF directory, by its model_type."""
    return hf.load_pretrained(open_huggingface(path))


def jax_logits(model_cfg, params, tokens) -> np.ndarray:
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    return np.asarray(jax.jit(lambda p, t: model_def.module(p)(t))(params, tokens))


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


def assert_greedy_equals_transformers(model, path: str, name: str, vocab: int) -> None:
    """`NEW` greedy tokens through jaxscale's KV cache (`generate.load_model(hf_dir=)`) equal
    transformers' `generate` on two `PROMPT`-token prompts."""
    prompt = np.random.default_rng(1).integers(1, vocab, (2, PROMPT)).astype(np.int32)
    with torch.no_grad():
        ref = model.generate(torch.from_numpy(prompt).long(), max_new_tokens=NEW,
                             do_sample=False,
                             attention_mask=torch.ones(2, PROMPT, dtype=torch.long)).numpy()
    assert ref.shape == (2, PROMPT + NEW)
    config, params = gen.load_model(hf_dir=path)
    assert config.model.name == name
    np.testing.assert_array_equal(gen.generate_from_config(config, params, prompt, NEW), ref)


def assert_import_export_import_exact(model, path: str, tmp_path, length: int = 12) -> dict:
    """HF -> launch.convert's workdir -> HF: the original's tensors bit for bit, a config
    transformers loads (as the original's class) with equal logits, and the same import
    again. Returns the converted model config."""
    model_cfg = convert.hf_to_workdir(path, str(tmp_path / "converted"))
    out = convert.workdir_to_hf(str(tmp_path / "converted"), str(tmp_path / "export"))
    # The files save_pretrained wrote (transformers >= 5 may hold experts fused in memory, and
    # writes the checkpoint layout; a tied lm_head is not written).
    original, exported = hf.SafetensorsReader(path), hf.SafetensorsReader(out)
    assert set(exported.keys()) == set(original.keys())
    assert ("lm_head.weight" in exported.keys()) != model_cfg["tie_embeddings"]
    for k in exported.keys():
        np.testing.assert_array_equal(exported.get(k), original.get(k))
    reloaded = type(model).from_pretrained(out).eval()
    tokens = torch.arange(length).reshape(1, length)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(tokens).logits.numpy(),
                                      model(tokens).logits.numpy())
    first, again = load(path), load(out)
    assert again.config == first.config == model_cfg
    for k, v in flatten(first.params).items():
        np.testing.assert_array_equal(flatten(again.params)[k], v)
    return model_cfg


def edited_copy(path: str, out: str, change: dict) -> str:
    """A copy of HF directory `path` at `out` with `change` applied to its config.json."""
    shutil.copytree(path, out)
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.update(change)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return out


def assert_load_and_save_dispatch(path: str, opener, tmp_path) -> None:
    """`hf.load` reads what the family's own opener reads (by config.json's model_type),
    `hf.save` writes the family's layout (by model.name): the original tensors, bit for bit,
    which `hf.load` reads back to the same model."""
    model, direct = hf.load(path), hf.load_pretrained(opener(path))
    assert model.config == direct.config
    got, want = flatten(model.params), flatten(direct.params)
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v)
    out = hf.save(model, str(tmp_path / "saved"))
    with open(os.path.join(out, "config.json")) as f, \
            open(os.path.join(path, "config.json")) as g:
        assert json.load(f)["model_type"] == json.load(g)["model_type"]
    original, written = hf.SafetensorsReader(path), hf.SafetensorsReader(out)
    assert set(written.keys()) == set(original.keys())
    for k in written.keys():
        np.testing.assert_array_equal(written.get(k), original.get(k))
    again = hf.load(out)
    assert again.config == model.config
    for k, v in flatten(again.params).items():
        np.testing.assert_array_equal(v, got[k])
