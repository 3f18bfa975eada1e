"""Models own themselves: one model table (config, module, tasks, FLOP counts, Hugging Face
converters) with clear errors, generic code that asks it and never names a model, no import of
training from the models, and pipeline runners that satisfy the `LayerRunner` interface."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from jaxscale import models
from jaxscale.errors import ConfigError
from jaxscale.mesh import make_mesh
from jaxscale.models import vit
from jaxscale.models.decoder import lm_task
from jaxscale.models.decoder.config import LlamaConfig
from jaxscale.models.decoder.llama import Llama
from jaxscale.models.runner import LayerRunner
from jaxscale.models.task import Task
from jaxscale.parallel.gpipe import PipelineRunner
from jaxscale.parallel.onef1b import OneFOneB
from jaxscale.parallel.schedules import make_layer_runner


def test_tables_name_every_model_and_task():
    assert set(models.MODELS) == {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                                 "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3",
                                 "vit"}
    assert {n: list(e.tasks) for n, e in models.MODELS.items()} == {
        "llama": ["lm"], "mistral": ["lm"], "qwen2": ["lm"], "qwen3": ["lm"], "gemma3": ["lm"],
        "gemma2": ["lm"], "mixtral": ["lm"], "qwen3_moe": ["lm"], "gpt_oss": ["lm"],
        "deepseek_v2": ["lm"], "deepseek_v3": ["lm"], "vit": ["classify"]}
    with pytest.raises(ConfigError, match="model.name='gpt9'.*'deepseek_v2', 'deepseek_v3', "
                                          "'gemma2', 'gemma3', 'gpt_oss', 'llama', 'mistral', "
                                          "'mixtral', 'qwen2', 'qwen3', 'qwen3_moe', 'vit'"):
        models.lookup("gpt9")
    with pytest.raises(ConfigError, match="model.task='rank' for model.name='llama'.*'lm'"):
        models.task_of({"name": "llama", "task": "rank"})
    with pytest.raises(ConfigError, match="model.task='lm' for model.name='vit'.*'classify'"):
        models.task_of({"name": "vit", "task": "lm"})
    # model.task may be left out (the model's own) or name it, as shipped configs do.
    assert models.task_of({}) is models.task_of({"name": "llama", "task": "lm"}) is lm_task.LM
    assert models.task_of({"name": "vit"}) is models.task_of(
        {"name": "vit", "task": "classify"}) is vit.CLASSIFY


@pytest.mark.parametrize("name", ["tiny_lm", "vit_digits"])
def test_task_batch_spec_is_what_the_data_yields(name):
    """A step compiled from the task's batch spec (no data read) takes the batches training
    feeds it: same names, shapes and dtypes."""
    import importlib

    from jaxscale.data.packing import carries_segments
    from jaxscale.data.registry import build_data

    if name == "vit_digits":
        pytest.importorskip("sklearn")  # the digits
    c = importlib.import_module(f"configs.{name}").get_config("test")
    batch = next(build_data(c, 0, 1)[0].iterator())
    spec = models.task_of(c.model).batch_spec(c.model, c.data.batch_size, c.data.seq_len,
                                              carries_segments(c.data))
    assert {k: (v.shape, v.dtype) for k, v in spec.items()} == {
        k: (v.shape, v.dtype) for k, v in batch.items()}


# The generic code: what asks the model table instead of naming a model or a task.
GENERIC = ("train/step.py", "train/build.py", "inference/evaluate.py", "observe/metrics.py",
           "interop/convert.py", "weights/sources.py", "aot/flops.py",
           "aot/choices.py", "aot/memory.py", "aot/traffic.py", "aot/guess.py", "inference/generate.py")


@pytest.mark.parametrize("rel", GENERIC)
def test_generic_code_names_no_model(rel):
    text = (Path(models.__file__).parents[1] / rel).read_text()
    for needle in ('"llama"', '"vit"', "'llama'", "'vit'", '"lm"', '"classify"', "task ==",
                   "task !=", "hf_vit", "with_target_counts", "llama_flops_per_token",
                   "vit_flops_per_token", "lm_loss", "classify_loss"):
        assert needle not in text, f"jaxscale/{rel} names {needle}: ask the model table entry"
    imports = [line for line in text.splitlines()
               if re.match(r"\s*(from|import) ", line) and re.search(r"\b(llama|vit)\b", line)]
    assert not imports, f"jaxscale/{rel} imports a model module: {imports}"


def _toy_entry(calls: list, token_batches: bool = True, hf: models.HuggingFace | None = None
               ) -> models.ModelEntry:
    """A throwaway family (the Llama's module, a task and counts of its own) that records
    what the generic code asks of it."""
    def prepare(batch):
        calls.append("prepare")
        return {**batch, "weight": jnp.full(batch["tokens"].shape[:1], 3.0)}

    def loss(model, batch, run_layers=None):
        calls.append("loss")
        return batch["weight"][0] * lm_task.lm_loss(model, batch, run_layers)

    task = Task(loss, lm_task.eval_sums, lm_task.batch_spec, unit="tokens", prepare=prepare,
                token_batches=token_batches)
    return models.ModelEntry(LlamaConfig, Llama, {"toy_task": task},
                             flops_per_token=lambda m, t: 1000.0 * t,
                             attention_flops=lambda m, t: 10.0 * t, hf=hf)


TOY = dict(name="toy", vocab_size=16, embed=8, num_layers=1, num_heads=2, num_kv_heads=1,
           head_dim=4, mlp=16)


def test_a_new_family_is_one_table_line(monkeypatch, tmp_path):
    """Registered in the table (and nowhere else), a family is trained, counted, planned and
    refused export by the generic code through its entry."""
    from jaxscale.aot import choices, flops
    from jaxscale.interop import hf
    from jaxscale.observe.metrics import model_flops_per_token
    from jaxscale.precision import get_policy
    from jaxscale.train.step import accumulate_grads, loss_and_metrics
    from jaxscale.weights.sources import read_hf_config

    calls = []
    monkeypatch.setitem(models.MODELS, "toy", _toy_entry(calls))
    model_def = models.ModelDef.build(TOY, get_policy("32-true"))
    assert model_def.task is models.MODELS["toy"].tasks["toy_task"]
    params = model_def.init_params(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, 16)
    loss, _ = accumulate_grads(params, {}, {"tokens": tokens}, model_def, 1)
    plain = lm_task.lm_loss(model_def.module(params), {"tokens": tokens})
    assert calls == ["prepare", "loss"] and float(loss) == pytest.approx(3 * float(plain))
    with pytest.raises(KeyError, match="weight"):  # the loss alone: no preparation
        loss_and_metrics(params, {}, {"tokens": tokens}, model_def)

    assert model_flops_per_token(TOY, 8) == 8000.0
    config = ml_collections.ConfigDict(dict(
        model=dict(TOY, attention="splash"), data=dict(seq_len=128, batch_size=4)))
    assert flops.model_flops(config, 2) == 1000.0 * 128 * 4 * 128 / 2
    assert flops.kernel_flops(config, 2) == 10.0 * 128 * 4 * 128 / 2
    assert flops.expected_flops(config, 2) is None  # no recompute count: unknown, not wrong
    choices.require_language_model(config)
    with pytest.raises(hf.ConversionError, match="model.name='toy' has no Hugging Face"):
        models.hf_saver(TOY)

    monkeypatch.setitem(models.MODELS, "toy", _toy_entry(
        calls, token_batches=False, hf=models.HuggingFace(
            "toy_hf", "jaxscale.interop.hf:open_llama", "jaxscale.interop.hf:save_llama")))
    with pytest.raises(ConfigError, match="model.name='toy' is not one"):
        choices.require_language_model(config)
    assert models.hf_saver(TOY) is hf.save_llama
    (tmp_path / "config.json").write_text('{"model_type": "toy_hf"}')
    assert models.hf_opener(read_hf_config(str(tmp_path)), str(tmp_path)) is hf.open_llama
    with pytest.raises(hf.ConversionError, match=r"model_type='gpt9'; jaxscale converts \["):
        models.hf_opener({"model_type": "gpt9"}, str(tmp_path))


def test_models_import_nothing_from_training():
    code = ("import sys, jaxscale.models, jaxscale.models.adapters.lora; print([m for m in sys.modules "
            "if m.startswith(('jaxscale.train', 'jaxscale.parallel'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("schedule, cls, fuses", [
    ("gpipe", PipelineRunner, False), ("circular", PipelineRunner, False),
    ("1f1b", OneFOneB, True)])
def test_runners_satisfy_the_interface(schedule, cls, fuses):
    mesh = make_mesh({"pipeline": 2, "data": 4})
    runner = make_layer_runner(dict(schedule=schedule, microbatches=2,
                                    repeats=2 if schedule == "circular" else 1), mesh, "none", 4)
    assert isinstance(runner, cls) and isinstance(runner, LayerRunner)
    assert runner.microbatches == 2 and runner.fuses_loss is fuses
    assert isinstance(runner.scaled(2.0), cls)
