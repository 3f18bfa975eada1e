"""Every shipped config and variant validates and shards on its intended mesh, without allocating;
config mistakes on the command line fail with one paragraph; the fine-tuning preset runs."""

import functools
import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import ml_collections as mlc
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from child_env import child_env
from jaxscale import config as config_lib
from jaxscale.errors import ConfigError
from jaxscale.mesh import MESH_AXES, resolve_mesh_shape
from jaxscale.models import ModelDef
from jaxscale.models.adapters import lora
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.precision import get_policy
from jaxscale.rules import AxisRules
from jaxscale.weights.place import param_specs
from jaxscale.weights.tree import flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(p for p in glob.glob(os.path.join(ROOT, "jaxscale", "configs", "*.py"))
                      if not os.path.basename(p).startswith("_"))  # `configs.bundled_names`
DEFAULT_DEVICES = 8  # a variant whose mesh has a -1 axis is checked on the test's 8 devices


def load(path: str):
    """Loads a config file by path, as ml_collections does for --config."""
    name = "_test_configs_" + os.path.basename(path)[:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


MODULES = {os.path.basename(p): load(p) for p in CONFIG_FILES}
CASES = [(f, v) for f, m in MODULES.items() for v in m.VARIANTS]


def test_every_config_file_advertises_its_variants():
    assert {"tiny_lm.py", "llama.py", "finetune_lm.py", "vit_digits.py"} <= set(MODULES)
    for name, module in MODULES.items():
        assert isinstance(module.VARIANTS, tuple) and module.VARIANTS, name
    assert {"tiny", "125m", "1b", "7b", "1b,v5e-16", "7b,h100x8", "125m,v4-8"} <= set(
        MODULES["llama.py"].VARIANTS)
    assert {"test", "test,lora", "1b,lora", "7b,lora,h100x8"} <= set(
        MODULES["finetune_lm.py"].VARIANTS)


@functools.lru_cache(maxsize=None)
def _model_def(model_json: str, precision: str, lora_json: str) -> ModelDef:
    """Abstract model (shapes + logical axes only; `nnx.eval_shape`), shared by variants."""
    policy = get_policy(precision)
    return lora.with_adapters(ModelDef.build(json.loads(model_json), policy),
                              mlc.ConfigDict(json.loads(lora_json)))


def intended_mesh(config) -> AbstractMesh:
    """The mesh a variant asks for: its explicit sizes, or DEFAULT_DEVICES if one axis is -1."""
    sizes = [config.mesh[a] * config.mesh[f"dcn_{a}"] for a in MESH_AXES]
    devices = DEFAULT_DEVICES if -1 in sizes else math.prod(sizes)
    ici, dcn = resolve_mesh_shape(config.mesh, devices)
    return AbstractMesh(tuple(ici[a] * dcn[a] for a in MESH_AXES), MESH_AXES)


@pytest.mark.parametrize("filename,variant", CASES, ids=[f"{f}:{v}" for f, v in CASES])
def test_variant_validates_and_shards_abstractly(filename, variant, tmp_path):
    config = MODULES[filename].get_config(variant)
    if config.init_from is None:  # a required field (fine-tuning): refused until it is set
        with pytest.raises(ConfigError, match="init_from is required"):
            config_lib.validate(config)
        config.init_from = str(tmp_path)
    config_lib.validate(config)
    mesh = intended_mesh(config)
    rules = AxisRules.from_config(config)
    model_def = _model_def(json.dumps(config.model.to_dict(), sort_keys=True), config.precision,
                           json.dumps(config.lora.to_dict()))
    specs = param_specs(model_def, rules, mesh)  # raises if a rule does not fit the mesh
    assert set(specs) == set(model_def.shapes())
    # Each accumulation step's rows split evenly over the batch's mesh axes.
    batch_axes = rules.spec(("batch", "length"), (config.data.batch_size, 1), mesh)[0] or ()
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
    rows = config.data.batch_size // config.train.grad_accum
    assert rows % math.prod(mesh.shape[a] for a in batch_axes) == 0


@pytest.mark.parametrize("fields, culprit", [
    (dict(rope_scaling="longrope"), "model.rope_scaling='longrope' is not a supported rotary "
                                    "scaling; use one of none, linear, llama3, yarn"),
    (dict(rope_scaling="dynamic"), "'dynamic'"),
    (dict(rope_scaling="linear", rope_factor=0.0), "model.rope_factor=0.0 must be positive"),
    (dict(rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=4.0,
          rope_high_freq_factor=1.0), r"needs 0 < rope_low_freq_factor \(4.0\)"),
])
def test_unknown_or_bad_rope_scaling_is_a_config_error(fields, culprit):
    c = MODULES["tiny_lm.py"].get_config("test")
    c.model.update(fields)
    with pytest.raises(ConfigError, match=culprit):
        config_lib.validate(c)


def test_llama3_rope_scaling_from_config_fields():
    """config.model.rope_* fields reach the model: llama3 and linear validate and change the
    frequencies every attention layer rotates with."""
    c = MODULES["tiny_lm.py"].get_config("test")
    plain = LlamaConfig.from_config(c.model).rope.inv_frequencies(c.model.head_dim)
    c.model.update(rope_scaling="llama3", rope_factor=8.0, rope_original_max_len=64)
    config_lib.validate(c)
    scaled = LlamaConfig.from_config(c.model).rope.inv_frequencies(c.model.head_dim)
    assert np.asarray(scaled)[0] == np.asarray(plain)[0]  # the fastest band is kept
    np.testing.assert_allclose(np.asarray(scaled)[-1], np.asarray(plain)[-1] / 8.0, rtol=1e-6)
    c.model.update(rope_scaling="linear", rope_factor=2.0)
    config_lib.validate(c)
    linear = LlamaConfig.from_config(c.model).rope.inv_frequencies(c.model.head_dim)
    np.testing.assert_allclose(np.asarray(linear), np.asarray(plain) / 2.0, rtol=1e-6)


def test_llama_parameter_counts():
    llama = MODULES["llama.py"]
    expected = {"125m": (120e6, 140e6), "1b": (1.0e9, 1.25e9), "7b": (6.6e9, 6.9e9)}
    for size, (lo, hi) in expected.items():
        n = LlamaConfig(**llama.SIZES[size].model).num_params()
        assert lo <= n <= hi, (size, n)
        model_def = _model_def(json.dumps(llama.get_config(size).model.to_dict(), sort_keys=True),
                               "bf16-mixed",
                               json.dumps(config_lib.base_config().lora.to_dict()))
        assert model_def.num_params() == n == llama.num_params(size)


def test_hardware_targets_set_what_they_promise():
    llama = MODULES["llama.py"]
    c = llama.get_config("7b,h100x8")
    assert c.model.attention == "dot_product_attention" and c.precision == "bf16-mixed"
    assert (c.mesh.fsdp, c.rules_preset, c.model.remat) == (8, "fsdp", "full")
    c = llama.get_config("1b,v5e-16")
    assert (c.mesh.fsdp, c.model.attention, c.data.batch_size) == (16, "splash", 256)
    assert llama.get_config("tiny,v5e-16").model.attention == "einsum"  # 64 tokens: off-grid
    assert llama.get_config("125m,v4-8").mesh.data == 4
    assert llama.get_config("1b,2xh100x8").mesh.dcn_data == 2
    with pytest.raises(ConfigError, match="does not fit v5e-8.*TPU compiler.*Targets that fit "
                       "7b: v4-32, v5e-16"):
        llama.get_config("7b,v5e-8")
    with pytest.raises(ConfigError, match="SIZE in tiny, 125m, 1b, 7b"):
        llama.get_config("2b")


def test_gpu_presets_size_with_the_one_memory_model():
    """7b on h100x8 by hand: N = 6,738,415,616 parameters (Llama-2-7B's), FSDP over 8, full
    remat, fused attention (no scores). State 22 N / 8 = 18,530,642,944 bytes; one gathered
    layer in bf16 2 x 2 N / 32 = 842,301,952; per token the 32 layers' bf16 inputs 32 x 4,096 x
    2, two layers' activations 2 x (10 x 4,096 + 4 x 11,008) x 2 and the float32 logits' three
    buffers 3 x 32,000 x 4: 986,112 bytes."""
    from jaxscale.aot.memory import state_bytes_per_param

    llama = MODULES["llama.py"]
    # f32 weights, Adam's two moments, gradient, accumulator, bf16 copy.
    assert llama.STATE_BYTES_PER_PARAM == state_bytes_per_param() == 22
    t = llama.TARGETS["h100x8"]
    assert llama.num_params("7b") == 6_738_415_616
    fixed = 18_530_642_944 + 842_301_952
    assert llama.memory_estimate("7b", t, 2) == fixed + 2 * 2048 * 986_112 == 23_412_059_648
    # The largest power of two within 80% of the device's 80 GiB (64 GiB): 16 sequences
    # (51.7e9 bytes), not 32 (84.0e9).
    assert llama.micro_batch("7b", "h100x8") == 16
    assert llama.memory_estimate("7b", t, 16) == 51_685_862_912 <= 64 * 2**30
    assert llama.memory_estimate("7b", t, 32) == 83_998_780_928 > 64 * 2**30


def test_family_presets_have_the_published_shapes_and_the_table_flops():
    """finetune_lm.py's Qwen3, Qwen2.5, Mistral, Gemma 3 and Gemma 2 presets build their model table family at
    the published parameter counts (tied embeddings counted once, Qwen2's biases and Qwen3's
    q/k norms included), size their targets with the one memory model, and take FLOPs per
    token from the table entry, where the switches add none."""
    from jaxscale.models import entry_of
    from jaxscale.models.decoder.flops import flops_per_token

    finetune, llama = MODULES["finetune_lm.py"], MODULES["llama.py"]
    published = {"qwen3-0.6b": ("qwen3", 596_049_920), "qwen2.5-0.5b": ("qwen2", 494_032_768),
                 "mistral-7b": ("mistral", 7_248_023_552), "gemma3-1b": ("gemma3", 999_885_952),
                 "gemma2-2b": ("gemma2", 2_614_341_888)}
    assert set(finetune.FAMILIES) == set(published)
    for size, (name, n) in published.items():
        c = finetune.get_config(f"{size},lora,h100x8")
        assert c.model.name == name and c.lora.rank == 16 and c.model.remat == "full"
        model_def = _model_def(json.dumps(finetune.get_config(size).model.to_dict(),
                                          sort_keys=True), "bf16-mixed",
                               json.dumps(config_lib.base_config().lora.to_dict()))
        assert model_def.num_params() == n == llama.num_params(size, finetune.FAMILIES)
        plain = {**c.model.to_dict(), "name": "llama"}  # the same widths, no switches
        assert entry_of(c.model).flops_per_token(c.model, 2048) == flops_per_token(plain, 2048)
        t = llama.TARGETS["h100x8"]
        b = llama.micro_batch(size, "h100x8", finetune.FAMILIES)
        assert c.data.batch_size // (c.train.grad_accum * t.total) == b
        assert llama.memory_estimate(size, t, b, finetune.FAMILIES) <= (
            llama.HBM_FRACTION * t.hbm_gib * 2**30)
    built = {size: entry_of(m).config_cls.from_config(m) for size in published
             for m in [finetune.get_config(size).model]}
    assert built["qwen3-0.6b"].qk_norm and not built["qwen3-0.6b"].qkv_bias
    assert built["qwen2.5-0.5b"].qkv_bias and not built["qwen2.5-0.5b"].qk_norm
    assert built["mistral-7b"].sliding_window == 0 and built["qwen3-0.6b"].tie_embeddings
    assert finetune.get_config("mistral-7b,v5e-64").model.attention == "splash"
    # Gemma: HF's pattern (every 6th / 2nd layer global), Gemma 2's soft-caps; the mixed
    # pattern runs splash on TPUs (a local and a global kernel, one per layer) and keeps einsum
    # on GPUs (cuDNN's kernel takes a static window only).
    g3, g2 = built["gemma3-1b"], built["gemma2-2b"]
    assert [i for i, t in enumerate(g3.layer_types) if t == "full_attention"] == [5, 11, 17, 23]
    assert g3.qk_norm and g3.rope_local_theta == 1e4 and g3.sliding_window == 512
    assert g2.layer_types[:2] == ("sliding_attention", "full_attention") and not g2.qk_norm
    assert (g2.attn_softcap, g2.final_softcap) == (50.0, 30.0)
    for variant, kernel in (("gemma3-1b,v5e-16", "splash"), ("gemma2-2b,lora,v5e-64", "splash"),
                            ("gemma2-2b,lora,h100x8", "einsum")):
        assert finetune.get_config(variant).model.attention == kernel
    with pytest.raises(ConfigError, match="mistral-7b model does not fit v5e-16.*Targets that "
                       "fit mistral-7b: v4-32, v5e-64, v5e-256, h100x8, 2xh100x8"):
        finetune.get_config("mistral-7b,lora,v5e-16")
    with pytest.raises(ConfigError, match="split the 896-wide embed"):
        finetune.get_config("qwen2.5-0.5b,v5e-256")


def _run(*args, timeout=300):
    env = child_env()
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("override,expected", [
    ("--config.train.stepz=3", "config.train has no field 'stepz'. Did you mean "
                               "--config.train.steps?"),
    ("--config.trian.steps=3", "the config has no field 'trian'. Did you mean --config.train?"),
    ("--config.train.steps=abc", "config.train.steps has type int (currently 10), and 'abc' "
                                 "does not parse as int"),
    ("--config.optim.lr=fast", "config.optim.lr has type float"),
    ("--config.train.grad_accum=5", "data.batch_size=16 must be divisible by "
                                    "train.grad_accum=5"),
    ("--config.data=5", "config.data is a group of fields, not a value. Set one of its fields, "
                        "e.g. --config.data.FIELD=VALUE; its fields: batch_size,"),
    ("--config.train.log_every=0", "train.log_every=0: it must be positive"),
])
def test_cli_config_mistakes_are_one_paragraph(tmp_path, override, expected):
    out = _run("launch.train", "--config=configs/tiny_lm.py:test", f"--workdir={tmp_path}",
               "--cpu_devices=8", override)
    assert out.returncode != 0
    assert expected in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    error_lines = [l for l in out.stderr.splitlines() if l.startswith("jaxscale: error:")]
    assert len(error_lines) == 1


def test_a_config_file_without_a_usable_get_config_is_one_paragraph(tmp_path):
    files = {"noget.py": "def config():\n    return None\n",
             "none.py": "def get_config(arg=None):\n    pass\n",
             "noarg.py": "def get_config():\n    return None\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for spec, expected in (("noget.py", "noget.py defines no get_config."),
                           ("none.py", "its get_config returned None, not a config."),
                           ("noarg.py:test", "takes 0 positional arguments but 1 was given); "
                                             "the command line passes 'test' to it.")):
        out = _run("launch.train", f"--config={tmp_path / spec}", f"--workdir={tmp_path}/w",
                   *(["--config.train.steps=3"] if spec == "none.py" else []))  # read of None
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        [line] = [l for l in out.stderr.splitlines() if l.startswith("jaxscale: error:")]
        assert expected in line and "def get_config(arg=None)" in line, line
    twice = _run("launch.train", "--config=configs/tiny_lm.py:test", f"--workdir={tmp_path}/w",
                 "--config=configs/tiny_lm.py")
    assert twice.returncode == 2 and "--config is given 2 times" in twice.stderr, twice.stderr
    assert not (tmp_path / "w").exists()


def test_an_unknown_flag_is_named_with_the_commands_own_flags(tmp_path):
    out = _run("jaxscale", "train", "--config=tiny_lm:test", f"--workdir={tmp_path}/w",
               "--workdr=x")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert ("--workdr is not a flag of this command. Did you mean --workdir? Its flags: "
            "--config,") in out.stderr and "log_dir" not in out.stderr, out.stderr
    launcher = _run("jaxscale", "lofi-local", f"--store={tmp_path}/s", "--config=tiny_lm")
    assert launcher.returncode == 2 and "go after `--`" in launcher.stderr, launcher.stderr
    assert not (tmp_path / "w").exists() and not (tmp_path / "s").exists()


def test_cli_unknown_variant_and_default_config_typo(tmp_path):
    out = _run("launch.train", "--config=configs/llama.py:2b", f"--workdir={tmp_path}")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "SIZE in tiny, 125m, 1b, 7b and TARGET in v4-8" in out.stderr
    # Without --config=, ml_collections checks the overrides when the flag is defined.
    out = _run("launch.train", f"--workdir={tmp_path}", "--config.train.stepz=3")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "no field 'stepz'" in out.stderr


def test_inspect_a_preset_without_allocating():
    out = _run("launch.inspect", "--config=configs/llama.py:1b,v5e-16", "--cpu_devices=16",
               "--compile=false")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "data=1 pipeline=1 fsdp=16 tensor=1 (16 cpu devices)" in out.stdout
    assert "('fsdp', None)" in out.stdout  # lm_head sharded on embed


def test_large_vocab_on_byte_data():
    """The presets' 32000-entry vocabulary trains on byte tokens (a subset of its ids)."""
    from jaxscale.train.loop import Trainer
    c = MODULES["llama.py"].get_config("tiny")
    c.model.vocab_size = 32000
    trainer = Trainer.build(c, workdir=None)
    batch = trainer.to_global(next(trainer.batches.iterator()))
    _, metrics = trainer.train_fn(trainer.state, batch)
    assert abs(float(metrics["loss"]) - math.log(32000)) < 0.5


def test_finetune_from_a_pretraining_run(tmp_path):
    """llama.py:tiny pre-trains on part a; finetune_lm.py:test starts from its checkpoint and
    trains; the LoRA variant loads the same weights as its frozen base."""
    from jaxscale.train import loop
    pre = MODULES["llama.py"].get_config("tiny")
    pre.data.part = "a"
    pre.train.update(steps=2, eval_every=0)
    pre.checkpoint.every = 2
    pretrained = flatten(loop.train(pre, str(tmp_path / "pre")).params)
    for variant in ("test", "test,lora"):
        c = MODULES["finetune_lm.py"].get_config(variant)
        c.init_from = str(tmp_path / "pre")
        c.train.update(steps=2, eval_every=0)
        workdir = tmp_path / variant.replace(",", "_")
        trainer = loop.prepare(c, str(workdir))  # built, config.json written
        start = flatten(trainer.state.frozen if variant.endswith("lora") else trainer.state.params)
        for path, value in pretrained.items():
            np.testing.assert_array_equal(np.asarray(start[path]), np.asarray(value))
        saved = json.loads((workdir / "config.json").read_text())
        assert saved["init_from"] == str(tmp_path / "pre") and saved["data"]["part"] == "b"
    trainer.run()  # the LoRA variant, for a couple of steps
    lines = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2] and all(np.isfinite(l["loss"]) for l in lines)


def test_generic_validation_asks_the_family_for_decoder_and_mesh_fields():
    """A ViT config carries no decoder fields (no kv heads, no max_len: the validation no longer
    asks for them), and the mesh checks run by family: a decoder's sequence shards and experts
    by its own checks, a family without either refuses `mesh.context` and `mesh.expert`."""
    vit = MODULES["vit_digits.py"].get_config("test")
    assert not {"num_kv_heads", "max_len", "attention_kind"} & set(vit.model.keys())
    config_lib.validate(vit)
    vit.model.num_kv_heads = 4
    with pytest.raises(ConfigError, match="config.model has no field 'num_kv_heads'"):
        config_lib.validate(vit)
    for axis in ("context", "expert"):
        vit = MODULES["vit_digits.py"].get_config("test")
        vit.mesh.update({"data": 1, axis: 2})
        with pytest.raises(ConfigError, match=f"mesh.{axis} x mesh.dcn_{axis}=2, but "
                                              "model.name='vit' has no"):
            config_lib.validate(vit)
    lm = MODULES["tiny_lm.py"].get_config("test")
    lm.mesh.update(data=1, expert=2)
    with pytest.raises(ConfigError, match="a dense model has none"):
        config_lib.validate(lm)


def test_each_subsystem_checks_its_own_section():
    """`config.validate` asks each section's owner: the model table checks `model` by family
    (the Llama's rotary rule does not apply to the ViT), storage checks `storage`, profiling
    checks `train.profile`."""
    vit = MODULES["vit_digits.py"].get_config("test")
    vit.model.head_dim = 5
    config_lib.validate(vit)
    lm = MODULES["tiny_lm.py"].get_config("test")
    lm.model.head_dim = 5
    with pytest.raises(ConfigError, match=r"model.head_dim=5 must be even for rotary"):
        config_lib.validate(lm)
    for section, field, value, culprit in [
            ("storage", "timeout_s", 0.0, r"storage.timeout_s=0.0 must be > 0"),
            ("train.profile", "host_tracing", 7, r"train.profile.host_tracing=7"),
            ("model", "remat", "most", r"model.remat='most' is not a remat policy")]:
        c = MODULES["tiny_lm.py"].get_config("test")
        node = c
        for part in section.split("."):
            node = node[part]
        node[field] = value
        with pytest.raises(ConfigError, match=culprit):
            config_lib.validate(c)
