"""DeepSeek's FP8 block-quantised checkpoints (`interop/hf_fp8.py`): the dequantisation equals
transformers' own (`_dequantize_fp8_weight`, fine-grained FP8), cut-short edge blocks included;
a tiny DeepSeek-V3 quantised to FP8 imports as the dequantised weights, in float32 or bf16; a
wrong-shaped scale and another quantisation are one paragraph."""

import json
import os

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from jaxscale.errors import ConversionError
from jaxscale.interop import hf
from jaxscale.interop.hf_fp8 import dequantize
from jaxscale.weights.tree import flatten
from tests.test_hf_deepseek import COMMON, VARIANTS

BLOCK = 16  # the test model's block (the published: 128), so its widths leave edge blocks
FP8_CONFIG = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                  weight_block_size=[BLOCK, BLOCK])


def _quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(float8_e4m3fn weight, float32 scale_inv per block) as DeepSeek's quantiser makes them:
    each block scaled so that its largest magnitude is FP8's 448."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    scale = np.ones((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            amax = np.abs(w[i * block:(i + 1) * block, j * block:(j + 1) * block]).max()
            scale[i, j] = max(amax, 1e-12) / 448.0
    full = np.repeat(np.repeat(scale, block, 0), block, 1)[:rows, :cols]
    return (w / full).astype(ml_dtypes.float8_e4m3fn), scale


def _torch(a: np.ndarray) -> "torch.Tensor":
    if a.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a))


def _transformers(q: np.ndarray, scale: np.ndarray, block) -> np.ndarray:
    return _dequantize_fp8_weight(_torch(q), torch.from_numpy(scale), list(block),
                                  torch.float32).numpy()


@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)),  # whole blocks
                                         ((200, 300), (128, 128)),  # edge blocks cut short
                                         ((576, 7168), (128, 128)),  # kv_a_proj: 4.5 rows
                                         ((45, 70), (16, 32))])
def test_dequantisation_equals_transformers(shape, block):
    w = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    q, _ = _quantize(w, block[0]) if block[0] == block[1] else (w.astype(
        ml_dtypes.float8_e4m3fn), None)
    scale = np.random.default_rng(1).uniform(0.5, 2.0, size=(
        -(-shape[0] // block[0]), -(-shape[1] // block[1]))).astype(np.float32)
    np.testing.assert_array_equal(dequantize(q, scale, block), _transformers(q, scale, block))


def test_a_wrong_shaped_scale_is_one_paragraph():
    q = np.zeros((200, 300), ml_dtypes.float8_e4m3fn)
    with pytest.raises(ConversionError, match=r"model.layers.0.mlp.up_proj.weight_scale_inv "
                                              r"has shape \(1, 3\).*needs \(2, 3\)") as err:
        dequantize(q, np.ones((1, 3), np.float32), (128, 128), "model.layers.0.mlp.up_proj.weight")
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(an FP8 DeepSeek-V3 directory, the same model's directory of transformers' dequantised
    weights): every projection quantised, the embedding, head, routers and norms not."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**COMMON, **VARIANTS["v3"]}))
    base = tmp_path_factory.mktemp("fp8")
    model.save_pretrained(base / "orig", safe_serialization=True)
    tensors = hf.SafetensorsReader(str(base / "orig"))
    fp8, plain = {}, {}
    for name in tensors.keys():
        w = tensors.get(name)
        if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight"):
            q, scale = _quantize(w, BLOCK)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            plain[name] = _transformers(q, scale, (BLOCK, BLOCK))
        else:
            fp8[name] = plain[name] = w
    with open(base / "orig" / "config.json") as f:
        config = json.load(f)
    for kind, data, cfg in (("fp8", fp8, {**config, "quantization_config": FP8_CONFIG}),
                            ("plain", plain, config)):
        os.makedirs(base / kind)
        save_file({k: _torch(v) for k, v in data.items()}, str(base / kind / "model.safetensors"),
                  metadata={"format": "pt"})
        with open(base / kind / "config.json", "w") as f:
            json.dump(cfg, f)
    return str(base / "fp8"), str(base / "plain")


def test_an_fp8_checkpoint_imports_dequantised(checkpoints, tmp_path):
    fp8, plain = checkpoints
    got, want = hf.load(fp8), hf.load(plain)
    assert got.config == want.config
    assert set(flatten(got.params)) == set(flatten(want.params))
    for k, v in flatten(want.params).items():
        np.testing.assert_array_equal(flatten(got.params)[k], v)
    # In the run's dtype: the dequantised float32 rounded once.
    bf16 = hf.load(fp8, dtype="bf16")
    for k, v in flatten(want.params).items():
        np.testing.assert_array_equal(flatten(bf16.params)[k], v.astype(ml_dtypes.bfloat16))
    # The export writes the dequantised weights, no scales, no quantization_config.
    out = hf.save(got, str(tmp_path / "out"))
    written = hf.SafetensorsReader(out)
    assert not any(k.endswith("_scale_inv") for k in written.keys())
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)


def test_another_quantisation_is_one_paragraph(checkpoints, tmp_path):
    from tests.hf_common import edited_copy

    path = edited_copy(checkpoints[0], str(tmp_path / "q"), dict(
        quantization_config=dict(quant_method="bitsandbytes", load_in_4bit=True)))
    with pytest.raises(ConversionError, match="quant_method") as err:
        hf.load(path)
    assert "\n" not in str(err.value)
