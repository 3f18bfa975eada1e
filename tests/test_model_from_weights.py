"""`config.init_from` supplies the model (issue 45): a Hugging Face directory of every family
the model table converts fine-tunes with `finetune_lm:test,lora` and no model flag, directly and
after `convert`; flags may set only `weights.resolve.SAFE`'s fields, a contradicting one is
refused naming it; the tokenizer comes along; `inspect` reads only the shapes.

Every family resolves its model from its directory and from its conversion alike. The training
test compiles once per family: the run from the conversion reuses the run from the directory's
compiled step, starting from a state whose base was zeroed and then loaded from the
conversion, and must reproduce its losses exactly. It trains a dense, a mixture-of-experts and a
latent-attention family by default (`TRAINED`); the others are exhaustive variants (each
family's weight mapping is proven against transformers by its tests/test_hf_*.py)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from child_env import child_env
from jaxscale.configs import finetune_lm
from jaxscale.interop import convert
from jaxscale.weights.resolve import SAFE, InitFromError, resolve
from jaxscale.weights.sources import Recorded, recorded
from jaxscale.weights.tree import flatten, unflatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None)
# model.name -> (HF config class, HF model class, what the family adds to SHAPE)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=5e5)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"])),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    # Latent attention; the router's selection bias is a frozen parameter init_from fills.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, n_group=2, topk_group=1, first_k_dense_replace=1)),
}


def make_hf(name: str, path: str, **change) -> str:
    """A tiny random HF model of family `name` saved at `path` (byte-level vocabulary)."""
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra, **change})
    getattr(transformers, model_cls)(config).save_pretrained(path)
    return path


def finetune(init_from: str, variant: str = "test,lora"):
    c = finetune_lm.get_config(variant)
    c.init_from = init_from
    c.train.update(steps=2, eval_every=0, loggers=())
    return c


def save_tokenizer(directory: str, vocab: int) -> None:
    """A byte-level BPE `tokenizer.json` of `vocab` ids, and a chat template beside it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world, the model comes with its weights"] * 20,
                            trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                show_progress=False))
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{{ messages }}"}, f)


class Losses:
    """A loop hook keeping the logged losses."""

    def __init__(self):
        self.seen = []

    def after_step(self, info):
        return None

    def at_end(self, info):
        return None

    def on_metrics(self, info):
        self.seen.append(info.metrics["loss"])


TRAINED = ("llama", "qwen3_moe", "deepseek_v3")  # dense, mixture of experts, latent attention


def _resolved(name: str, tmp_path) -> tuple:
    """The family's HF directory, its conversion, and the run config resolved from each; checks
    they agree with each other and with every field the weights record."""
    hf_dir = make_hf(name, str(tmp_path / "hf"))
    conv = str(tmp_path / "conv")
    converted = convert.hf_to_workdir(hf_dir, conv)
    direct, after = resolve(finetune(hf_dir)), resolve(finetune(conv))
    assert direct.model.to_dict() == after.model.to_dict()
    assert not direct.model_from_weights  # named now: the run's config.json records it
    got = flatten(direct.model.to_dict())
    for key, value in flatten(converted).items():  # every field the weights record
        assert got[key] == (tuple(value) if isinstance(value, list) else value), key

    wrong = finetune(hf_dir)
    wrong.model.num_layers = 3
    with pytest.raises(InitFromError, match=r"--config.model.num_layers=3 where the weights "
                                            r"have 2"):
        resolve(wrong, {"model.num_layers"})
    return hf_dir, conv, direct, after


@pytest.mark.parametrize("name", sorted(set(FAMILIES) - set(TRAINED)))  # TRAINED: below
def test_a_family_resolves_its_model_from_its_directory_and_from_its_conversion(name,
                                                                                 tmp_path):
    _resolved(name, tmp_path)


@pytest.mark.slow  # a compile per family
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in TRAINED else pytest.mark.exhaustive)
    for name in sorted(FAMILIES)])
def test_a_family_fine_tunes_from_its_directory_and_from_its_conversion(name, tmp_path):
    from jaxscale.train.loop import prepare
    from jaxscale.weights.init_from import load_params

    _, conv, direct, after = _resolved(name, tmp_path)
    workdir = tmp_path / "run"
    trainer = prepare(direct, str(workdir), devices=jax.devices()[:1])  # writes config.json
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["model"] == json.loads(json.dumps(direct.model.to_dict()))
    assert convert.read_model_config(str(workdir))[0] == saved["model"]  # evaluate, export
    blank = jax.tree.map(jnp.copy, trainer.state)  # the run donates its state
    blank = blank.replace(frozen=jax.tree.map(jnp.zeros_like, blank.frozen))
    first = Losses()
    trainer.hooks.append(first)
    trainer.run()
    loaded = load_params(conv, blank, trainer.shardings, after.model)
    state, again = blank.replace(**{  # the conversion's weights in both parts of the state
        part: unflatten({k: loaded.get(k, v) for k, v in flatten(getattr(blank, part)).items()})
        for part in ("params", "frozen")}), []
    batches = trainer.batches.iterator(None)
    for _ in range(2):  # the step compiled above: same model, same shapes, same batches
        state, metrics = trainer.train_fn(state, trainer.to_global(next(batches)))
        again.append(float(metrics["loss"]))
    assert len(first.seen) == 2 and np.all(np.isfinite(first.seen))
    assert again == first.seen


def test_safe_flags_win_and_contradicting_ones_are_refused_with_both_values(tmp_path):
    hf_dir = make_hf("qwen3", str(tmp_path / "hf"))
    safe = dict(max_len=512, remat="full", attention="dot_product_attention", loss_chunks=2)
    c = finetune(hf_dir)
    c.model.update(safe)
    c.model.moe.capacity_factor = 1.5
    resolve(c, {f"model.{k}" for k in safe} | {"model.moe.capacity_factor"})
    assert {k: c.model[k] for k in safe} == safe and c.model.moe.capacity_factor == 1.5
    assert set(SAFE) >= set(safe) | {"moe.capacity_factor"}

    unflagged = resolve(finetune(hf_dir))  # SAFE's sources: the weights' max_len, the run's remat
    assert unflagged.model.max_len == 256 and unflagged.model.remat == "none"

    repeat = finetune(hf_dir)  # the long commands convert used to print still run
    repeat.model.update(name="qwen3", num_layers=2, head_dim=16, tie_embeddings=True)
    resolve(repeat, {"model.name", "model.num_layers", "model.head_dim", "model.tie_embeddings"})

    bad = finetune(hf_dir)
    bad.model.update(vocab_size=512, rope_theta=5e5, norm_eps=1e-5, name="llama")
    with pytest.raises(InitFromError) as err:
        resolve(bad, {"model.vocab_size", "model.rope_theta", "model.norm_eps", "model.name",
                      "model.moe.num_experts"})
    message = str(err.value)
    assert "\n" not in message
    for part in ("--config.model.vocab_size=512 where the weights have 256",
                 "--config.model.rope_theta=500000.0 where the weights have 10000.0",
                 "--config.model.norm_eps=1e-05 where the weights have 1e-06",
                 "--config.model.name=llama where the weights have 'qwen3'"):
        assert part in message, message
    assert "num_experts" not in message  # flagged at the weights' own value


def test_a_config_that_names_its_model_is_checked_not_replaced(tmp_path):
    hf_dir = make_hf("llama", str(tmp_path / "hf"))
    named = finetune(hf_dir, "1b,lora")
    with pytest.raises(InitFromError) as err:
        resolve(named)
    assert ("model.num_layers is 16 in the config but 2 in the weights" in str(err.value)
            and "--config.model_from_weights=true" in str(err.value))
    same = resolve(finetune(hf_dir))  # resolved: it names its model now
    same.model.max_len = 1024  # a SAFE field may differ
    assert resolve(same).model.to_dict() == same.model.to_dict()
    same.model.norm_eps = 1e-3  # one that leaves every shape equal may not
    with pytest.raises(InitFromError, match="model.norm_eps is 0.001 in the config but 1e-06"):
        resolve(same)


def test_every_source_records_its_model_and_tokenizer(tmp_path):
    """A HF directory and a conversion (with their tokenizer and chat template), a training
    workdir and its checkpoints directory, a Lo-Fi store; a bare params export records
    nothing, and the stand-in model is then kept."""
    from jaxscale.config import save_config
    from jaxscale.weights.init_from import export_params
    from jaxscale.weights.kv import Store

    hf_dir = make_hf("qwen3", str(tmp_path / "hf"))
    save_tokenizer(hf_dir, 200)
    conv = str(tmp_path / "conv")
    model = convert.hf_to_workdir(hf_dir, conv)
    assert recorded(hf_dir) == Recorded(model, tokenizer=hf_dir)
    assert recorded(conv) == Recorded(model, tokenizer=conv)
    assert os.path.isfile(os.path.join(conv, "tokenizer_config.json"))  # the chat template

    run = resolve(finetune(hf_dir))
    assert run.data.tokenizer == hf_dir
    workdir = str(tmp_path / "run")
    save_config(run, workdir)
    os.makedirs(os.path.join(workdir, "checkpoints", "2"))
    for place in (workdir, os.path.join(workdir, "checkpoints")):
        found = recorded(place)
        assert found.model == json.loads(json.dumps(run.model.to_dict()))
        assert found.tokenizer == hf_dir and found.lora["rank"] == 4
    store = Store(str(tmp_path / "store"))  # a Lo-Fi job records its config in the store
    store.write("config.json", open(os.path.join(workdir, "config.json"), "rb").read())
    assert recorded(str(tmp_path / "store")).model == found.model

    flagged = finetune(conv)
    flagged.data.tokenizer = "bytes"
    assert resolve(flagged, {"data.tokenizer"}).data.tokenizer == "bytes"

    bare = export_params(str(tmp_path / "bare"), {"x": np.zeros(2, np.float32)})
    assert recorded(bare) == Recorded()
    stand_in = finetune(bare)
    assert resolve(stand_in).model.to_dict() == finetune(bare).model.to_dict()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    from jaxscale.config import validate
    from jaxscale.errors import ConfigError

    hf_dir = make_hf("llama", str(tmp_path / "hf"))
    save_tokenizer(hf_dir, 300)
    (tmp_path / "a.txt").write_text("hello world\n")
    c = finetune(hf_dir)
    c.data.sources = f"text={tmp_path}/a.txt"
    with pytest.raises(ConfigError, match=r"model.vocab_size=256 is smaller than the 2\d\d tokens "
                                          r"of data.tokenizer='.*/hf'"):
        validate(resolve(c))


def test_export_carries_the_tokenizer_the_weights_came_with(tmp_path):
    hf_dir = make_hf("llama", str(tmp_path / "hf"))
    save_tokenizer(hf_dir, 200)
    conv = str(tmp_path / "conv")
    convert.hf_to_workdir(hf_dir, conv)
    out = convert.workdir_to_hf(conv, str(tmp_path / "out"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(hf_dir, name), "rb") as b:
            assert a.read() == b.read()


def test_inspect_reads_the_shapes_and_no_weight(tmp_path, monkeypatch):
    from jaxscale.aot.sharding_report import build_report
    from jaxscale.interop.safetensors_io import SafetensorsReader
    from jaxscale.weights import sources

    hf_dir = make_hf("qwen3", str(tmp_path / "hf"))

    def no_read(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(SafetensorsReader, "get", no_read)
    monkeypatch.setattr(SafetensorsReader, "get_slice", no_read)
    monkeypatch.setattr(sources, "open_weights", no_read)
    config = resolve(finetune(hf_dir, "test"))
    report = build_report(config, compile_step=False)
    shapes = {r.path: r.shape for r in report.rows}
    assert shapes["layers/attn/q_norm/scale"] == (2, 16)  # Qwen3's, from config.json
    assert shapes["embedding"] == (256, 32) and "lm_head" not in shapes  # tied


def cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = child_env(JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_command_line_takes_the_model_and_refuses_a_contradicting_flag(tmp_path):
    hf_dir = make_hf("qwen2", str(tmp_path / "hf"))
    refused = cli("launch.train", "--config=finetune_lm:test,lora", f"--workdir={tmp_path}/r",
                  f"--config.init_from={hf_dir}", "--config.model.num_layers=3")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    message = refused.stderr.strip().splitlines()[-1]
    assert message.startswith("jaxscale: error: ") and \
        "--config.model.num_layers=3 where the weights have 2" in message, message
    shown = cli("launch.inspect", "--config=finetune_lm:test,lora", "--compile=false",
                f"--config.init_from={hf_dir}", "--config.model.remat=full")
    assert shown.returncode == 0, shown.stderr
    assert "layers/attn/bqkv" in shown.stdout  # Qwen2's q/k/v bias: the model is the weights'


def test_convert_prints_the_one_line_command():
    lm = convert.finetune_command("runs/my model", {"name": "qwen3"})
    assert lm == ("jaxscale train --config=finetune_lm:lora --workdir=RUN "
                  "--config.init_from='runs/my model' --config.data.sources='text=YOUR/FILES/*.txt'")
    assert "--config.model_from_weights=true" in convert.finetune_command("v", {"name": "vit"})


def test_lora_adapters_on_experts_are_per_expert_and_merge_exactly():
    import ml_collections as mlc

    from jaxscale.errors import ConfigError
    from jaxscale.models import ModelDef
    from jaxscale.models.adapters import lora
    from jaxscale.precision import get_policy

    model_cfg = dict(name="mixtral", vocab_size=64, embed=16, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=8, mlp=24, max_len=32,
                     moe=dict(num_experts=4, experts_per_token=2))
    lora_cfg = mlc.ConfigDict(dict(rank=2, alpha=4.0, targets=("mlp/w_",), dropout=0.0))
    model_def = lora.with_adapters(ModelDef.build(model_cfg, get_policy("32-true")), lora_cfg)
    params = flatten(model_def.init_params(jax.random.key(0)))
    assert params["layers/mlp/w_gate_lora_a"].shape == (2, 4, 16, 2)  # layers, expert, in, r
    assert params["layers/mlp/w_down_lora_b"].shape == (2, 4, 2, 16)  # layers, expert, r, out
    rng = np.random.default_rng(0)
    params = {k: rng.normal(size=v.shape).astype(np.float32) if k.endswith("_lora_b") else v
              for k, v in params.items()}
    tokens = jnp.arange(12).reshape(1, 12)
    adapted = model_def.module(unflatten(params))(tokens)
    plain = ModelDef.build(model_cfg, get_policy("32-true"))
    merged = lora.merge(unflatten(params), lora_cfg)  # export: the experts' deltas folded in
    for name in ("w_gate", "w_up", "w_down"):
        assert np.max(np.abs(merged["layers"]["mlp"][name] - params[f"layers/mlp/{name}"])) > 0.1
    np.testing.assert_allclose(np.asarray(adapted), np.asarray(plain.module(merged)(tokens)),
                               atol=1e-4)
    with pytest.raises(ConfigError, match="lora.dropout=0.1 with adapters on layers/mlp/w_gate"):
        lora.with_adapters(plain, mlc.ConfigDict(dict(lora_cfg.to_dict(), dropout=0.1)))


@pytest.mark.xdist_group("seaweedfs")
def test_a_conversion_and_a_workdir_in_a_bucket_supply_the_model(seaweedfs, tmp_path):
    """s3:// conversions and workdirs record their model and tokenizer as local ones do; a
    Hugging Face directory in a bucket is one paragraph (safetensors reads local files)."""
    from jaxscale.config import save_config
    from jaxscale.data.tokenizer import load_tokenizer
    from jaxscale.storage import locations, workdir_files
    from jaxscale.weights.sources import WeightsError

    _, bucket = seaweedfs
    hf_dir = make_hf("qwen3", str(tmp_path / "hf"))
    save_tokenizer(hf_dir, 200)
    out = f"s3://{bucket}/conv"
    model = convert.hf_to_workdir(hf_dir, out)
    try:
        run = resolve(finetune(out))
        assert run.model.name == "qwen3" and run.data.tokenizer == out
        assert {k: run.model[k] for k in model} == model
        assert load_tokenizer(out).vocab_size == load_tokenizer(hf_dir).vocab_size
        save_config(run, f"s3://{bucket}/run")
        again = resolve(finetune(f"s3://{bucket}/run"))
        assert again.model.to_dict() == run.model.to_dict() and again.data.tokenizer == out
        with open(os.path.join(hf_dir, "config.json"), "rb") as f:
            workdir_files.write_bytes(f"s3://{bucket}/hf/config.json", f.read())
        with pytest.raises(WeightsError, match="Hugging Face directories are read with local"):
            resolve(finetune(f"s3://{bucket}/hf"))
    finally:
        locations.configure()
