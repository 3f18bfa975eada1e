"""DeepSeek-V3's multi-token prediction (`model.mtp_depth=1`, `models/decoder/mtp.py`): the MTP
loss equals transformers' DeepSeek-V3 block and torch computing the module by hand from an
imported checkpoint's `model.layers.{N}.*` tensors; training with it on fsdp x tensor x expert
equals one device, `mtp_loss` is a step metric, generation ignores it, the MTP tensors survive
HF export and import bit for bit, and bad settings are one paragraph."""


import json
import os

import jax
import numpy as np
import pytest

from configs.tiny_lm import get_config
from jaxscale.config import validate
from jaxscale.errors import ConfigError
from jaxscale.models import ModelDef
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.lm_task import lm_loss
from jaxscale.models.task import step_metrics
from jaxscale.precision import get_policy
from jaxscale.train.loop import Trainer
from jaxscale.train.state import flatten

MOE = dict(num_experts=8, experts_per_token=2, router="sigmoid_group", n_group=4, topk_group=2,
           routed_scaling_factor=2.5, shared_experts=1, mlp=32, first_k_dense_replace=1,
           router_aux_loss_coef=0.0, bias_update_rate=1e-3)


def _config(mesh=None, **model):
    c = get_config("test")
    c.model.moe.update(MOE)
    c.model.update({**dict(attention_kind="latent", mtp_depth=1), **model})
    c.model.mla.update(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                       qk_nope_head_dim=8, v_head_dim=8)
    c.mesh.update({**dict(data=1, fsdp=1, tensor=1, expert=1), **(mesh or {})})
    return c


def _losses(model_def, params, batch):
    """(the training loss, the recorded `mtp_loss` or None) of one batch, jitted."""
    def f(p, b):
        model = model_def.module(p)
        loss = lm_loss(model, b)
        return loss, step_metrics(model).get("mtp_loss")
    loss, mtp = jax.jit(f)(params, batch)
    return float(loss), None if mtp is None else float(mtp)


def _run(c, devices, steps=3):
    trainer = Trainer.build(c, workdir=None, devices=devices)
    it = trainer.batches.iterator()
    state, out = trainer.state, []
    for _ in range(steps):
        state, metrics = trainer.train_fn(state, trainer.to_global(next(it)))
        out.append((float(metrics["loss"]), float(metrics["mtp_loss"])))
    return np.array(out), state


@pytest.mark.parametrize("mesh", [dict(fsdp=2, tensor=2, expert=2),
                                  pytest.param(dict(fsdp=4, tensor=2), marks=pytest.mark.exhaustive)])
def test_training_with_mtp_on_fsdp_x_tensor_x_expert_equals_one_device(mesh):
    """DeepSeek-V3's whole layer set (latent attention, a dense first layer, sigmoid group
    routing with a shared expert, bias balancing) with its MTP block, the experts split over
    `expert`: the losses, MTP losses and moved balancing biases (the main layers' and the MTP
    block's) of a sharded run equal one device's; the MTP loss is trained on (it falls) and
    weighed in the loss. The default proof of test_deepseek_moe.py's sharded training too."""
    c = _config()
    one, one_state = _run(c, jax.devices()[:1])
    assert one[-1, 0] < one[0, 0] and one[-1, 1] < one[0, 1]
    biases = {k: np.asarray(v) for k, v in flatten(one_state.frozen).items()
              if k.endswith("balance_bias")}
    assert set(biases) == {"layers/mlp/balance_bias", "mtp/block/mlp/balance_bias"}
    for bias in biases.values():  # the MTP block's router balanced like the others
        assert np.abs(bias).max() > 0
    sharded, state = _run(_config(mesh), jax.devices())
    np.testing.assert_allclose(sharded, one, rtol=1e-5)
    for k, bias in biases.items():
        np.testing.assert_array_equal(np.asarray(flatten(state.frozen)[k]), bias)


def test_the_loss_adds_the_weighted_mtp_loss_and_generation_ignores_the_module():
    c = _config(mtp_loss_weight=0.5)
    validate(c)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(0))
    assert model_def.num_params() == LlamaConfig.from_config(c.model).num_params()
    tokens = np.random.default_rng(0).integers(0, 256, (2, 9)).astype(np.int32)
    loss, mtp = _losses(model_def, params, {"tokens": tokens})
    plain_cfg = {**dict(c.model), "mtp_depth": 0}
    plain_def = ModelDef.build(plain_cfg, get_policy("32-true"))
    plain = {k: v for k, v in params.items() if k != "mtp"}
    main, none = _losses(plain_def, plain, {"tokens": tokens})
    assert none is None
    np.testing.assert_allclose(loss, main + 0.5 * mtp, rtol=1e-6)
    # The forward (what generation and evaluation call) is the model without the module.
    forward = lambda d, p: np.asarray(jax.jit(lambda p, t: d.module(p)(t))(p, tokens))
    np.testing.assert_array_equal(forward(model_def, params), forward(plain_def, plain))


@pytest.mark.parametrize("model,culprit", [
    (dict(mtp_depth=2), "mtp_depth=2"),
    (dict(mtp_loss_weight=-1.0), "mtp_loss_weight=-1.0"),
])
def test_mtp_mistakes_are_one_paragraph(model, culprit):
    with pytest.raises(ConfigError, match=culprit) as err:
        validate(_config(**model))
    assert "\n" not in str(err.value)


def test_mtp_with_pipeline_stages_is_refused():
    c = _config(dict(pipeline=2))
    c.model.moe.update(bias_update_rate=0.0, first_k_dense_replace=0)
    with pytest.raises(ConfigError, match="mtp_depth=1 with mesh.pipeline"):
        validate(c)


# ----------------------------------------------------------------------------- Hugging Face
HF = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
          intermediate_size=48,
          moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
          qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=2,
          n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2,
          first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=64,
          rms_norm_eps=1e-6, rope_theta=1e4, tie_word_embeddings=False, bos_token_id=None,
          eos_token_id=None, pad_token_id=0)
N = 2  # main layers; HF layer 2 is the MTP layer


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(a transformers DeepSeek-V3 with N + 1 layers whose last is the MTP block, the MTP
    tensors by name, the directory of the N-layer checkpoint with its MTP layer)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.numpy import save_file

    from jaxscale.interop.hf import SafetensorsReader

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**HF, num_hidden_layers=N + 1)
    config._attn_implementation = "eager"
    full = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in full.named_parameters():
            if "norm" in name or "gate.weight" in name:
                p.add_(0.2 * torch.randn_like(p))
    base = tmp_path_factory.mktemp("mtp")
    full.save_pretrained(base / "full", safe_serialization=True)
    reader = SafetensorsReader(str(base / "full"))
    tensors = {k: reader.get(k) for k in reader.keys()}
    rng, e, p = np.random.default_rng(0), HF["hidden_size"], f"model.layers.{N}."
    extra = {p + "enorm.weight": 1 + 0.2 * rng.normal(size=e),
             p + "hnorm.weight": 1 + 0.2 * rng.normal(size=e),
             p + "shared_head.norm.weight": 1 + 0.2 * rng.normal(size=e),
             p + "eh_proj.weight": rng.normal(size=(e, 2 * e)) / np.sqrt(2 * e)}
    extra = {k: v.astype(np.float32) for k, v in extra.items()}
    extra[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    extra[p + "shared_head.head.weight"] = tensors["lm_head.weight"]
    out = base / "with_mtp"
    out.mkdir()
    save_file({**tensors, **extra}, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = {**full.config.to_dict(), "num_hidden_layers": N, "num_nextn_predict_layers": 1}
    with open(out / "config.json", "w") as f:
        json.dump(hf_cfg, f)
    return full, extra, str(out)


def _torch_mtp_loss(full, extra, tokens):
    """The MTP loss computed by hand in torch: transformers' own modules for the main model
    (its first N layers and final norm) and for the MTP block (layer N), DeepSeek's MTP
    (vLLM's DeepSeekMultiTokenPredictorLayer) written out around them."""
    import torch
    import torch.nn.functional as F

    p = f"model.layers.{N}."
    w = {k.removeprefix(p): torch.from_numpy(v) for k, v in extra.items()}
    eps = HF["rms_norm_eps"]
    rms = lambda x, s: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * s
    tokens = torch.from_numpy(tokens).long()
    B, T = tokens.shape[0], tokens.shape[1] - 1
    inputs, pos = tokens[:, :T], torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    m = full.model
    with torch.no_grad():
        h = m.embed_tokens(inputs)
        pe = m.rotary_emb(h, pos)
        for layer in m.layers[:N]:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        h = m.norm(h)
        main = F.cross_entropy(full.lm_head(h).flatten(0, 1), tokens[:, 1:].flatten())
        x = torch.cat([rms(m.embed_tokens(tokens[:, 1:]), w["enorm.weight"]),
                       rms(h, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        x = m.layers[N](x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        logits = full.lm_head(rms(x, w["shared_head.norm.weight"]))[:, :T - 1]
        mtp = F.cross_entropy(logits.flatten(0, 1), tokens[:, 2:].flatten(), reduction="sum")
    return float(main), float(mtp) / (B * T)


def test_the_mtp_loss_of_an_imported_checkpoint_is_torchs(mtp_checkpoint):
    from jaxscale.interop import hf

    full, extra, path = mtp_checkpoint
    model_cfg, params = hf.load(path, mtp=True)
    assert model_cfg["mtp_depth"] == 1 and "mtp" in params
    tokens = np.random.default_rng(2).integers(0, HF["vocab_size"], (2, 11)).astype(np.int32)
    loss, mtp = _losses(ModelDef.build(model_cfg, get_policy("32-true")), params,
                        {"tokens": tokens})
    want_main, want_mtp = _torch_mtp_loss(full, extra, tokens)
    np.testing.assert_allclose(mtp, want_mtp, rtol=1e-5)
    np.testing.assert_allclose(loss, want_main + 0.3 * want_mtp, rtol=1e-5)  # the default
    # Without mtp=True the layer is left unread, as before.
    plain_cfg, plain = hf.load(path)
    assert not plain_cfg.get("mtp_depth") and "mtp" not in plain


def test_the_mtp_tensors_round_trip_bit_for_bit(mtp_checkpoint, tmp_path):
    from jaxscale.interop import hf
    from jaxscale.interop.hf import SafetensorsReader

    _, _, path = mtp_checkpoint
    model = hf.load(path, mtp=True)
    out = hf.save(model, str(tmp_path / "out"), mtp=True)
    original, exported = SafetensorsReader(path), SafetensorsReader(out)
    assert set(exported.keys()) == set(original.keys())
    for k in original.keys():
        np.testing.assert_array_equal(exported.get(k), original.get(k))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    again = hf.load(out, mtp=True)
    for k, v in flatten(model.params).items():
        np.testing.assert_array_equal(flatten(again.params)[k], v)
    # Without mtp=True the export leaves the module out.
    plain = SafetensorsReader(hf.save(model, str(tmp_path / "plain")))
    assert not any(k.startswith(f"model.layers.{N}.") for k in plain.keys())


def test_mtp_conversion_mistakes_are_one_paragraph(mtp_checkpoint, tmp_path):
    from jaxscale.errors import ConversionError
    from jaxscale.interop import hf

    _, _, path = mtp_checkpoint
    model_cfg, params = hf.load(path)
    with pytest.raises(ConversionError, match="mtp_depth=0, so the") as err:
        hf.save((model_cfg, params), str(tmp_path / "a"), mtp=True)
    assert "\n" not in str(err.value)


def test_convert_mtp_both_ways(mtp_checkpoint, tmp_path):
    """`jaxscale convert --from_hf --mtp` / `--to_hf --mtp`: the MTP layer through a workdir."""
    from jaxscale.interop import convert
    from jaxscale.interop.hf import SafetensorsReader

    _, _, path = mtp_checkpoint
    model_cfg = convert.hf_to_workdir(path, str(tmp_path / "wd"), mtp=True)
    assert model_cfg["mtp_depth"] == 1
    out = convert.workdir_to_hf(str(tmp_path / "wd"), str(tmp_path / "hf"), mtp=True)
    original, exported = SafetensorsReader(path), SafetensorsReader(out)
    assert set(exported.keys()) == set(original.keys())
    for k in original.keys():
        np.testing.assert_array_equal(exported.get(k), original.get(k))


def test_packed_documents_each_get_their_own_mtp_loss():
    """Two documents packed in one row: the MTP loss's sum is the sum of each document's alone
    (t+2 targets stay inside their document; the block attends within it)."""
    c = get_config("test")
    c.model.update(mtp_depth=1)
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    params = model_def.init_params(jax.random.key(0))
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, 7), rng.integers(0, 256, 6)

    def mtp_sum(batch, count):
        return _losses(model_def, params, batch)[1] * count

    packed = {"tokens": np.concatenate([a, b])[None].astype(np.int32),
              "segment_ids": np.array([[1] * 7 + [2] * 6], np.int32),
              "positions": np.array([list(range(7)) + list(range(6))], np.int32)}
    alone = sum(mtp_sum({"tokens": d[None].astype(np.int32)}, len(d) - 1) for d in (a, b))
    np.testing.assert_allclose(mtp_sum(packed, 6 + 5), alone, rtol=1e-5)


def test_asking_another_family_for_its_mtp_layer_is_one_paragraph(tmp_path):
    from jaxscale.errors import ConversionError
    from jaxscale.interop import hf

    c = get_config("test")
    model_def = ModelDef.build(c.model, get_policy("32-true"))
    model = (c.model.to_dict(), model_def.init_params(jax.random.key(0)))
    with pytest.raises(ConversionError, match="model.name='llama' has no multi-token") as err:
        hf.save(model, str(tmp_path / "out"), mtp=True)
    assert "\n" not in str(err.value)
    out = hf.save(model, str(tmp_path / "plain"))
    with pytest.raises(ConversionError, match="converter has no option mtp") as err:
        hf.load(out, mtp=True)
    assert "\n" not in str(err.value)
