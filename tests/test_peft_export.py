"""`jaxscale convert --to_peft` (issue 41 item 7): a LoRA run's adapters as a PEFT adapter that
`peft.PeftModel.from_pretrained` puts on the Hugging Face base, computing our logits to 1e-4, as
does the merged `--to_hf` export; the families' own layouts (Llama, Qwen3's head_dim, Gemma's
norms), attention and MLP targets, a subset of them, and the refusals (a non-empty directory, a
run without adapters, a mixture's experts)."""

import json
import os

import jax
import ml_collections as mlc
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft", reason="peft is not installed (the `parity` extra)")

from jaxscale.errors import ConversionError
from jaxscale.interop import convert, hf
from jaxscale.interop import peft as jpeft
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora
from jaxscale.precision import get_policy
from jaxscale.weights.sources import open_huggingface
from jaxscale.weights.tree import flatten, unflatten

SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
FAMILIES = {  # name -> (HF config class, HF model class, what the family adds to SHAPE)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])),
}
ALL = ("attn/w[qkvo]$", "mlp/w_(gate|up|down)$")
TOKENS = (np.arange(24, dtype=np.int32).reshape(2, 12) * 5) % 256


def make_hf(name: str, path: str) -> str:
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    getattr(transformers, model_cls)(getattr(transformers, config_cls)(
        **{**SHAPE, **extra})).save_pretrained(path)
    return path


def peft_logits(base_dir: str, adapter_dir: str) -> np.ndarray:
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir).eval()
    model = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.numpy()


def hf_logits(directory: str) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(torch.from_numpy(TOKENS).long()).logits.numpy()


def jax_logits(model_def, params) -> np.ndarray:
    return np.asarray(jax.jit(lambda p: model_def.module(p)(TOKENS))(params))


@pytest.mark.parametrize("name,targets", [("llama", ALL), ("qwen3", ALL),
                                          ("gemma3", ("attn/w[qv]$", "mlp/w_down$"))])
def test_adapters_load_in_peft_with_our_logits(name, targets, tmp_path):
    """Random adapters (B nonzero, so they matter) on a family's HF weights: PEFT on the base
    and the merged export both compute our adapted model's logits; target_modules names the
    adapted projections only."""
    hf_dir = make_hf(name, str(tmp_path / "hf"))
    model_cfg, params = hf.load_pretrained(open_huggingface(hf_dir))
    lora_cfg = mlc.ConfigDict(dict(rank=4, alpha=6.0, targets=targets, dropout=0.0))
    model_def = lora.with_adapters(ModelDef.build(model_cfg, get_policy("32-true")), lora_cfg)
    rng = np.random.default_rng(0)
    flat = flatten(params)
    flat.update({k: rng.normal(0.0, 0.3, s.shape).astype(np.float32)
                 for k, s in model_def.shapes().items() if lora.is_adapter(k)})
    ours = jax_logits(model_def, unflatten(flat))
    assert np.max(np.abs(ours - hf_logits(hf_dir))) > 0.05  # the adapters change the model

    adapters = {k: v for k, v in flat.items() if lora.is_adapter(k)}
    out = jpeft.write_adapter(model_cfg, lora_cfg.to_dict(), adapters,
                              {k: v.shape for k, v in flat.items()}, str(tmp_path / "peft"),
                              base_model=hf_dir)
    np.testing.assert_allclose(peft_logits(hf_dir, out), ours, atol=1e-4)
    config = json.load(open(os.path.join(out, jpeft.ADAPTER_CONFIG)))
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 6.0, "LORA")
    assert config["base_model_name_or_path"] == hf_dir
    want = (["down_proj", "q_proj", "v_proj"] if name == "gemma3" else
            ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])
    assert config["target_modules"] == want

    merged = hf.save((model_cfg, lora.merge(unflatten(flat), lora_cfg)), str(tmp_path / "m"))
    np.testing.assert_allclose(hf_logits(merged), ours, atol=1e-4)


def test_target_modules_fall_back_to_full_names():
    """A short name that would also match unadapted modules is spelled out in full."""
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
    assert jpeft.target_modules(["model.layers.0.self_attn.q_proj"], names) == [
        "model.layers.0.self_attn.q_proj"]
    assert jpeft.target_modules([n.removesuffix(".weight") for n in names], names) == ["q_proj"]


def test_expert_adapters_are_refused_attention_ones_written():
    model_cfg = dict(name="mixtral", vocab_size=64, embed=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=8, mlp=24, max_len=32, tie_embeddings=False,
                     moe=dict(num_experts=4, experts_per_token=2))
    shapes = {}
    for targets in (("attn/w[qkvo]$", "mlp/w_"), ("attn/w[qkvo]$",)):
        lora_cfg = mlc.ConfigDict(dict(rank=2, alpha=4.0, targets=targets, dropout=0.0))
        model_def = lora.with_adapters(ModelDef.build(model_cfg, get_policy("32-true")),
                                       lora_cfg)
        shapes = {k: tuple(v.shape) for k, v in model_def.shapes().items()}
        adapters = {k: np.ones(s, np.float32) for k, s in shapes.items() if lora.is_adapter(k)}
        if len(targets) == 2:
            with pytest.raises(ConversionError, match=r"layers/mlp/w_\w+ holds one adapter pair "
                                                      r"per expert"):
                jpeft.peft_tensors(model_cfg, adapters, shapes)
        else:
            tensors, modules = jpeft.peft_tensors(model_cfg, adapters, shapes)
            assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
                           ].shape == (8, 2)
            assert len(modules) == 8


@pytest.mark.slow  # one LoRA training compile
def test_lora_run_to_peft_and_to_hf_match_our_logits(tmp_path):
    """A LoRA run fine-tuned from a HF Qwen3 directory: `--to_peft` on that base and `--to_hf`
    both give the run's logits; a non-empty directory needs --overwrite; a conversion output
    (no adapters) is refused."""
    from jaxscale.configs import finetune_lm
    from jaxscale.train import loop

    hf_dir = make_hf("qwen3", str(tmp_path / "hf"))
    run = str(tmp_path / "run")
    c = finetune_lm.get_config("test,lora")
    c.init_from = hf_dir
    c.lora.update(rank=4, alpha=6.0)
    c.optim.update(lr=3e-2, warmup_steps=0)
    c.train.update(steps=3, eval_every=0, loggers=())
    c.checkpoint.every = 3
    state = loop.train(c, run)

    out, base = convert.workdir_to_peft(run, str(tmp_path / "peft"))
    assert base == os.path.abspath(hf_dir)
    assert sorted(os.listdir(out))[:2] == ["adapter_config.json", "adapter_model.safetensors"]
    model_cfg, _ = convert.read_model_config(run)
    params = {**flatten(jax.device_get(state.frozen)), **flatten(jax.device_get(state.params))}
    model_def = lora.with_adapters(ModelDef.build(model_cfg, get_policy("32-true")),
                                   mlc.ConfigDict(convert.read_model_config(run)[1]))
    ours = jax_logits(model_def, unflatten(params))
    assert np.max(np.abs(ours - hf_logits(hf_dir))) > 1e-2  # training moved the adapters
    np.testing.assert_allclose(peft_logits(hf_dir, out), ours, atol=1e-4)
    merged = convert.workdir_to_hf(run, str(tmp_path / "merged"))
    np.testing.assert_allclose(hf_logits(merged), ours, atol=1e-4)

    with pytest.raises(ConversionError, match=r"is not empty .* add --overwrite"):
        convert.workdir_to_peft(run, out)
    convert.workdir_to_peft(run, out, overwrite=True, base_model="Qwen/Qwen3-0.6B")
    assert json.load(open(os.path.join(out, "adapter_config.json")))[
        "base_model_name_or_path"] == "Qwen/Qwen3-0.6B"
    conv = str(tmp_path / "conv")
    convert.hf_to_workdir(hf_dir, conv)
    with pytest.raises(ConversionError, match="is not a LoRA run"):
        convert.workdir_to_peft(conv, str(tmp_path / "none"))
    # the base an adapter names: a conversion's source directory, none for a jaxscale run
    assert convert.peft_base({"init_from": conv}) == os.path.abspath(hf_dir)
    assert convert.peft_base({"init_from": run}) is None and convert.peft_base({}) is None
