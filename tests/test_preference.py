"""Preference objectives (DPO, IPO, SimPO) against independent code, on every mesh they run on.

* DPO's per-pair loss and rewards equal the DPO formula applied to log-probabilities that
  transformers (torch) computes for two tiny Hugging Face Qwen3 models, the policy (`init_from`)
  and the reference (`objective.reference` = its directory), to 1e-4; IPO's and SimPO's losses
  equal their formulas on the same kind of numbers.
* With `reference="init"` the first step's loss is ln 2 with rewards 0; on a synthetic preference
  set with a learnable rule the held-out reward accuracy reaches 0.9; `jaxscale evaluate` says
  what the loop logged; a run resumed from its mid-way checkpoint (the reference rebuilt, not
  restored) ends where the uninterrupted run ends.
* Loss and gradients equal one device on fsdp x tensor, on data x fsdp with accumulation and
  under GPipe stages; 1F1B is refused in one paragraph. With LoRA, `"init"` holds no weights.
"""

from __future__ import annotations

import json
import math
import random
import shutil

import jax
import numpy as np
import pytest

from configs import tiny_lm
from jaxscale.errors import ConfigError
from jaxscale.objectives import Settings
from jaxscale.objectives.preference import pair_losses
from jaxscale.rules import use_rules
from jaxscale.train.loop import Trainer
from jaxscale.weights.tree import flatten
from tests.aot_common import TINY, libtpu_test, run_module
from tests.chat_common import WORDS, tokenizer_dir

GOOD, BAD = ("yes", "sure", "good", "fine", "thanks"), ("no", "bad", "maybe", "lazy", "dog")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(tokenizer directory, pairs.jsonl): the chosen response is made of GOOD words, the
    rejected one of BAD words, after a random question (a rule held-out pairs share)."""
    root = tmp_path_factory.mktemp("pref")
    rng = random.Random(0)
    lines = []
    for _ in range(400):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
        pick = lambda words: " ".join(rng.choice(words) for _ in range(rng.randint(1, 3)))
        lines.append(json.dumps({"prompt": prompt, "chosen": pick(GOOD), "rejected": pick(BAD)}))
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    return tokenizer_dir(str(root), "qwen3_generation"), str(root / "pairs.jsonl")


def pref_config(data, mesh=None, preset="", name="dpo", **pipeline):
    tok, pairs = data
    c = tiny_lm.get_config("test")
    c.model.update(vocab_size=512, embed=64, num_layers=2, num_heads=4, num_kv_heads=4,
                   head_dim=16, mlp=128)
    c.data.update(sources=f"preference={pairs}", tokenizer=tok, seq_len=32, eval_fraction=0.2,
                  eval_batches=2)
    c.objective.name = name
    c.optim.update(lr=1e-2, warmup_steps=0)
    if mesh is not None:
        c.mesh.update({**dict(data=1, pipeline=1, fsdp=1, tensor=1), **mesh})
        c.rules_preset = preset
        c.pipeline.update(pipeline)
    return c


def test_pair_losses_equal_the_formulas():
    rng = np.random.default_rng(0)
    logps, ref = -rng.uniform(1, 20, (6, 2)), -rng.uniform(1, 20, (6, 2))
    counts = rng.integers(1, 9, (6, 2)).astype(float)
    logsig = lambda x: -np.log1p(np.exp(-x))
    s = Settings(beta=0.3, label_smoothing=0.2, gamma=0.7)
    h = s.beta * ((logps[:, 0] - ref[:, 0]) - (logps[:, 1] - ref[:, 1]))
    want = {"dpo": -(0.8 * logsig(h) + 0.2 * logsig(-h))}
    m, mr = logps / counts, ref / counts
    want["ipo"] = ((m[:, 0] - mr[:, 0]) - (m[:, 1] - mr[:, 1]) - 1 / (2 * s.beta)) ** 2
    h = s.beta * (m[:, 0] - m[:, 1]) - s.gamma
    want["simpo"] = -(0.8 * logsig(h) + 0.2 * logsig(-h))
    for name, loss in want.items():
        got, chosen, rejected = pair_losses(name, s, logps, counts, ref)
        np.testing.assert_allclose(got, loss, rtol=1e-5)  # float32
    np.testing.assert_allclose(chosen, s.beta * m[:, 0], rtol=1e-5)  # simpo's, the last


def _hf_qwen3(path, seed):
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None, pad_token_id=0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def _torch_logps(model, tokens, mask):
    import torch
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens[:, :-1]).long()).logits.double()
    logp = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(tokens[:, 1:, None]).long())
    return (logp[..., 0].numpy() * (mask[:, 1:] > 0)).sum(axis=1)


def test_dpo_equals_the_formula_on_transformers_logps(data, tmp_path):
    pytest.importorskip("torch", reason="torch (the `parity` extra) computes the oracle")
    from jaxscale.weights.sources import open_huggingface

    policy, reference = (_hf_qwen3(str(tmp_path / n), seed) for n, seed in (("p", 0), ("r", 1)))
    c = pref_config(data)
    c.model.update(open_huggingface(str(tmp_path / "p")).model_cfg)
    c.init_from = str(tmp_path / "p")
    c.objective.update(reference=str(tmp_path / "r"), beta=0.5, label_smoothing=0.1)
    trainer = Trainer.build(c, workdir=None)  # 8 devices: both models sharded by the rules
    ctx, host = trainer.ctx, trainer.eval_data[0]

    @jax.jit
    def scores(state, batch):
        with use_rules(ctx.rules, ctx.mesh):
            return ctx.objective.scores(ctx.model_def.module(state.params),
                                        ctx.reference.model_def.module(state.reference),
                                        batch, None)[:3]

    losses, chosen, rejected = map(np.asarray, scores(trainer.state, trainer.to_global(host)))
    pc, pr = (_torch_logps(policy, host[f"{s}_tokens"], host[f"{s}_loss_mask"])
              for s in ("chosen", "rejected"))
    rc, rr = (_torch_logps(reference, host[f"{s}_tokens"], host[f"{s}_loss_mask"])
              for s in ("chosen", "rejected"))
    h = 0.5 * ((pc - rc) - (pr - rr))
    logsig = lambda x: -np.log1p(np.exp(-x))
    np.testing.assert_allclose(losses, -(0.9 * logsig(h) + 0.1 * logsig(-h)), atol=1e-4)
    np.testing.assert_allclose(chosen, 0.5 * (pc - rc), atol=1e-4)
    np.testing.assert_allclose(rejected, 0.5 * (pr - rr), atol=1e-4)
    assert np.abs(h).max() > 0.1  # two different models: the ratios are not trivially 0


def test_dpo_learns_a_rule_reports_it_and_resumes_exactly(data, tmp_path, capsys):
    from jaxscale.inference.evaluate import evaluate_workdir
    from jaxscale.observe.metrics import read_metrics
    from jaxscale.train.loop import prepare

    c = pref_config(data)
    c.train.update(steps=16, log_every=1, eval_every=8)
    c.checkpoint.update(every=8, keep=3)
    full = str(tmp_path / "full")
    final = prepare(c, full).run()
    logged = {m["step"]: m for m in read_metrics(full)}
    first = logged[1]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # The policy is the reference, but their forward passes are different programs (one is
    # differentiated): the rewards are 0 to float32 rounding, not bit for bit.
    for k in ("rewards_chosen", "rewards_rejected", "reward_margin"):
        assert abs(first[k]) <= 1e-5, (k, first[k])
    assert logged[16]["eval_reward_accuracy"] >= 0.9, logged[16]
    assert logged[16]["eval_reward_margin"] > 0 and logged[16]["loss"] < 0.3
    out = capsys.readouterr().out
    assert " acc=" in out and " eval_acc=" in out
    # `jaxscale evaluate` scores the newest checkpoint against the rebuilt reference.
    got = evaluate_workdir(full)
    for k in ("loss", "rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"):
        assert got[k] == pytest.approx(logged[16][f"eval_{k}"], abs=1e-5), k
    assert got["pairs"] == 2 * c.data.batch_size
    # Resumed from step 8: the same final weights as the uninterrupted run.
    resumed = str(tmp_path / "resumed")
    shutil.copytree(full, resumed)
    shutil.rmtree(f"{resumed}/checkpoints/16")
    again = prepare(c, resumed).run()
    want, have = flatten(jax.device_get(final.params)), flatten(jax.device_get(again.params))
    for k in want:
        np.testing.assert_allclose(have[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.fixture(scope="module")
def one_device(data):
    """A preference batch (uneven chosen lengths) and its loss and gradients on one device,
    with the chosen NLL added (`sft_weight`), whose count a split must share."""
    c = pref_config(data, {})
    c.objective.sft_weight = 0.5
    trainer = Trainer.build(c, workdir=None, devices=jax.devices()[:1])
    batch = trainer.eval_data[0]
    return batch, _loss_and_grads(trainer, batch)


def _loss_and_grads(trainer, batch):
    from jaxscale.train.step import accumulate_grads

    ctx = trainer.ctx

    @jax.jit
    def grads(state, batch):
        with use_rules(ctx.rules, ctx.mesh):
            return accumulate_grads(state.params, state.frozen, batch, ctx.model_def,
                                    ctx.grad_accum, ctx.run_layers, None, ctx.objective,
                                    ctx.bound_reference(state))

    loss, g = jax.device_get(grads(trainer.state, trainer.to_global(batch)))
    return float(loss), {k: np.asarray(v) for k, v in flatten(g).items()}


@pytest.mark.parametrize("mesh, preset, pipeline, grad_accum", [
    ({"fsdp": 4, "tensor": 2}, "fsdp_tp", {}, 1),
    ({"data": 2, "fsdp": 4}, "fsdp", {}, 2),
    ({"pipeline": 2, "data": 4}, "pp", dict(schedule="gpipe", microbatches=2), 1),
])
def test_dpo_equals_one_device(data, one_device, mesh, preset, pipeline, grad_accum):
    batch, (want_loss, want) = one_device
    c = pref_config(data, mesh, preset, **pipeline)
    c.objective.sft_weight = 0.5
    c.train.grad_accum = grad_accum
    loss, grads = _loss_and_grads(Trainer.build(c, workdir=None), batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for k in want:
        assert np.linalg.norm(grads[k] - want[k]) <= 1e-5 * np.linalg.norm(want[k]) + 1e-7, k


def test_a_setting_no_objective_of_the_run_reads_is_refused_by_name():
    """Each objective reads some of `config.objective`; a changed value it ignores (gamma under
    dpo, GRPO's sampling under lm) is refused rather than silently unused."""
    from jaxscale.objectives import check_objective
    c = tiny_lm.get_config("test")
    c.objective.update(name="dpo", gamma=1.0)
    with pytest.raises(ConfigError, match=r"objective.name='dpo' does not read "
                                          r"objective.gamma=1.0 \(read by simpo\)"):
        check_objective(c, "preference")
    c.objective.name = "simpo"
    check_objective(c, "preference")
    c.objective.gamma = -1.0
    with pytest.raises(ConfigError, match=r"objective.gamma=-1.0 must be >= 0 for simpo"):
        check_objective(c, "preference")
    grpo = tiny_lm.get_config("test")
    grpo.objective.update(name="grpo", rewards="m:f", max_new_tokens=8)
    grpo.data.packing = "pack"
    with pytest.raises(ConfigError, match=r"data.packing='pack' .* would be ignored"):
        check_objective(grpo, "prompts")
    lm = tiny_lm.get_config("test")
    lm.objective.num_generations = 8
    with pytest.raises(ConfigError, match=r"'lm' does not read objective.num_generations=8"):
        check_objective(lm, "text")


def test_config_mistakes_are_one_paragraph(data):
    from jaxscale.config import validate

    cases = [
        (dict(schedule="1f1b"), "pipeline.schedule='1f1b' runs a next-token loss"),
        (dict(name="ipo", label_smoothing=0.1), "has no meaning for ipo"),
        (dict(name="orpo"), "objective.name='orpo' is not an objective"),
        (dict(name="lm"), "objective.name='lm' cannot train on"),
        (dict(beta=0.0), "objective.beta=0.0 must be positive"),
    ]
    for fields, match in cases:
        c = pref_config(data, {"pipeline": 2, "data": 4}, "pp", microbatches=2)
        c.pipeline.schedule = fields.pop("schedule", "gpipe")
        c.objective.update(fields)
        with pytest.raises(ConfigError, match=match):
            validate(c)
    c = tiny_lm.get_config("test")
    c.objective.name = "dpo"
    with pytest.raises(ConfigError, match="trains on preference pairs, but data.sources holds"):
        validate(c)


def test_the_reference_is_counted_and_lora_init_holds_none(data):
    from jaxscale.aot.guess import dims_of, remat_bytes
    from jaxscale.mesh import make_mesh
    from jaxscale.train.build import build_step

    def reference_leaves(config):
        abstract, _ = build_step(config, make_mesh(config.mesh)).abstract_state()
        return flatten(abstract.reference), flatten(abstract.params)

    full = pref_config(data)
    ref, params = reference_leaves(full)
    assert {k: v.shape for k, v in ref.items()} == {k: v.shape for k, v in params.items()}
    lm = pref_config(data, name="simpo")  # reference-free
    assert not reference_leaves(lm)[0]
    mesh = dict(data=8, fsdp=1, tensor=1)
    args = (mesh, 1, "einsum", 1, "none")
    extra = remat_bytes(full, dims_of(full), *args) - remat_bytes(lm, dims_of(lm), *args)
    n = sum(int(np.prod(v.shape)) for v in params.values())
    assert extra == pytest.approx(1.5 * 4 * n)  # one float32 copy, times the guess's calibration
    lora = pref_config(data)
    lora.lora.update(rank=4, targets=("attn/w[qv]$",))
    assert not reference_leaves(lora)[0]
    trainer = Trainer.build(lora, workdir=None)
    assert trainer.state.reference == {} and trainer.ctx.reference.in_state is False
    _, metrics = trainer.train_fn(trainer.state, trainer.to_global(trainer.eval_data[0]))
    assert float(metrics["loss"]) == pytest.approx(math.log(2), abs=1e-6)  # adapters start at 0


@pytest.mark.exhaustive
@libtpu_test
def test_tpu_compile_counts_the_reference(data, tmp_path):
    """`jaxscale compile`'s arguments per chip hold the reference: dpo's exceed simpo's (the
    same step, reference-free) by the parameters' bytes over the FSDP shards (widths that are
    multiples of 128, so that TPU tiling pads nothing)."""
    tok, pairs = data
    dims = dict(vocab_size=512, embed=256, mlp=512, num_heads=2, num_kv_heads=2, head_dim=128)
    reports = {}
    for name in ("dpo", "simpo"):
        out = tmp_path / f"{name}.json"
        proc = run_module(["launch.compile", "--topology=v5p:2x2x1", *TINY,
                           "--config.mesh.fsdp=4",
                           *(f"--config.model.{k}={v}" for k, v in dims.items()),
                           f"--config.data.sources=preference={pairs}",
                           f"--config.data.tokenizer={tok}", f"--config.objective.name={name}",
                           f"--out={out}"], tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports[name] = json.loads(out.read_text())
    import math

    from jaxscale.configs import llama
    from jaxscale.mesh import make_mesh
    from jaxscale.models import ModelDef
    from jaxscale.precision import get_policy
    from jaxscale.rules import AxisRules, as_tuple
    from jaxscale.weights.place import param_specs
    config = llama.get_config("tiny")
    config.model.update(dims)
    config.mesh.update(data=1, fsdp=4)
    model_def = ModelDef.build(config.model, get_policy("bf16-mixed"))
    mesh = make_mesh(config.mesh, jax.devices()[:4])
    shapes = model_def.shapes()
    per_chip = sum(  # float32 parameters, each over the mesh axes its spec names
        4 * math.prod(shapes[k].shape) / math.prod(mesh.shape[a] for d in spec
                                                   for a in as_tuple(d))
        for k, spec in param_specs(model_def, AxisRules.from_config(config), mesh).items())
    extra = reports["dpo"]["argument_bytes"] - reports["simpo"]["argument_bytes"]
    assert extra == pytest.approx(per_chip, rel=0.01)


@pytest.mark.exhaustive
@pytest.mark.parametrize("name", ["ipo", "simpo"])
def test_ipo_and_simpo_train(data, name):
    """The other objectives run the same step and move their loss (simpo with no reference)."""
    from tests.helpers import train_steps

    c = pref_config(data, name=name)
    c.objective.beta = 2.0 if name == "simpo" else 0.1
    losses, state, trainer = train_steps(c, 6)
    assert (trainer.ctx.reference is None) == (name == "simpo")
    assert bool(state.reference) == (name == "ipo")  # ipo holds a copy, simpo none
    assert np.isfinite(losses).all() and losses[-1] < losses[0]


def test_a_reference_of_another_model_is_blamed_on_the_reference(data, tmp_path):
    """Reference weights recording another model than the policy's name objective.reference
    and the fields that differ, and ask for the policy's model (not init_from's message, whose
    fix, changing config.model, would break the run)."""
    from jaxscale.train.reference import ReferenceError, reference_leaves

    c = pref_config(data)
    other = {**c.model.to_dict(), "num_layers": 3, "embed": 32}
    ref = tmp_path / "other_run"
    ref.mkdir()
    (ref / "config.json").write_text(json.dumps({"model": other}))
    with pytest.raises(ReferenceError) as e:
        reference_leaves(str(ref), {}, c.model)
    text = str(e.value)
    assert text.startswith(f"objective.reference={str(ref)!r} holds another model than the policy")
    assert "model.num_layers is 2 for the policy but 3 in the reference" in text
    assert "model.embed is 64" in text and "objective.reference=init" in text
    assert "init_from" not in text and "model_from_weights" not in text
