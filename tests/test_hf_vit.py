"""Hugging Face ViT import/export: logits parity with transformers, exact round trip, sharded
placement by the rules."""

import json
import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxscale.interop import hf, hf_vit
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.precision import get_policy
from jaxscale.weights.place import param_specs
from jaxscale.weights.tree import flatten


def make_hf(tmp_path, channels=3, image=16, patch=4):
    torch.manual_seed(0)
    config = transformers.ViTConfig(image_size=image, patch_size=patch, num_channels=channels,
                                    hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, num_labels=5)
    model = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():  # randomise the zero-initialised biases/norms and the tiny cls token
        for _, p in model.named_parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = str(tmp_path / "vit")
    model.save_pretrained(path, safe_serialization=True)
    return model, path


def logits(model_cfg, params, images):
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    return np.asarray(jax.jit(lambda p, x: model_def.module(p)(x))(params, images))


@pytest.mark.parametrize("channels, image, patch", [(3, 16, 4), (1, 8, 2)])
def test_logits_match_transformers(tmp_path, channels, image, patch):
    model, path = make_hf(tmp_path, channels, image, patch)
    model_cfg, params = hf_vit.load_vit(path)
    assert model_cfg["num_classes"] == 5 and model_cfg["task"] == "classify"
    pixels = np.random.default_rng(0).normal(size=(3, channels, image, image)).astype(np.float32)
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(pixels)).logits.numpy()
    got = logits(model_cfg, params, pixels.transpose(0, 2, 3, 1))
    assert got.shape == ref.shape == (3, 5)
    assert np.max(np.abs(got - ref)) < 1e-4


def test_round_trip_is_exact(tmp_path):
    model, path = make_hf(tmp_path)
    model_cfg, params = hf_vit.load_vit(path)
    out = hf_vit.save_vit(hf_vit.load_vit(path), str(tmp_path / "export"))
    exported = hf.SafetensorsReader(out)
    original = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(exported.keys()) == set(original)
    for k in original:
        np.testing.assert_array_equal(exported.get(k), original[k])
    reloaded = transformers.ViTForImageClassification.from_pretrained(out).eval()
    pixels = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(pixel_values=pixels).logits.numpy(),
                                      model(pixel_values=pixels).logits.numpy())


def test_sharded_load_follows_rules(tmp_path):
    _, path = make_hf(tmp_path)
    mesh = make_mesh(dict(data=1, pipeline=1, fsdp=2, tensor=4))
    rules = hf.default_rules()
    model_cfg, sharded = hf_vit.load_vit(path, mesh=mesh, rules=rules)
    _, host = hf_vit.load_vit(path)
    specs = param_specs(ModelDef.build(model_cfg, get_policy("32-true")), rules, mesh)
    for key, arr in flatten(sharded).items():
        assert arr.sharding.spec == specs[key], key
        np.testing.assert_array_equal(np.asarray(arr), flatten(host)[key])
    assert specs["layers/attn/wq"][2] == "tensor" and specs["layers/mlp/w_in"][1] == "fsdp"


@pytest.mark.parametrize("change, culprit", [
    (dict(hidden_act="relu"), "relu"),
    (dict(qkv_bias=False), "qkv_bias"),
    (dict(image_size=None, patch_size=None), "image_size, patch_size"),
])
def test_rejects_unsupported(tmp_path, change, culprit):
    _, path = make_hf(tmp_path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg.update(change)
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(hf.ConversionError, match=culprit):
        hf_vit.load_vit(path)
