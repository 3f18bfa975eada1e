"""The `grpo` objective through the real train step, on meshes, resumed, and its bad inputs.

One seeded rollout batch of a tiny model (sampled by `jaxscale/rl/rollout.py` on the training
mesh) is trained on: the step's loss, KL, clip fraction and gradient norm equal
`objectives/grpo.policy_loss` on log-probabilities taken independently (the model's logits,
log-softmaxed and gathered here) at a second update of the rollout, where ratios are not 1;
the same update on fsdp x tensor with gradient accumulation equals one device; a run stopped
between two updates of a rollout and resumed logs the losses of the uninterrupted run; and
reward specs, reward results and settings that cannot work stop with one paragraph.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.grpo_toy import run as run_toy
from bench.grpo_toy import toy_config
from jaxscale import config as config_lib
from jaxscale.errors import ConfigError
from jaxscale.objectives.grpo import policy_loss, row_weights
from jaxscale.rl.rewards import RewardError, load_rewards, score
from jaxscale.rl.rollout import RolloutSource, prepare_grpo
from jaxscale.train.loop import Trainer


def _toy(directory: str):
    """A toy grpo config (2 steps), with its prompts and reward module in `directory`."""
    c = toy_config(directory, steps=2)
    c.data.batch_size = 16  # 4 prompts x 4 completions
    c.objective.update(num_generations=4, beta=0.05, updates_per_rollout=2,
                       loss_norm="sequence", epsilon=0.1, epsilon_high=0.15)
    c.optim.lr = 3e-2
    return c


@pytest.fixture
def toy(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    return _toy(str(tmp_path))


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """`_two_updates` of the toy config on one device, shared by the tests that compare."""
    directory = str(tmp_path_factory.mktemp("grpo"))
    sys.path.insert(0, directory)
    try:
        return _two_updates(_toy(directory))
    finally:
        sys.path.remove(directory)


def _copy(tree):
    return jax.tree.map(lambda x: np.array(jax.device_get(x)), tree)


def _two_updates(config) -> tuple[dict, list[dict], dict, Trainer]:
    """(the rollout batch, both steps' metrics, the params before the second, the trainer) of
    `config` on one device; checks the batch's rows against the sampler's own output."""
    config.mesh.data = 1
    trainer = Trainer.build(config, workdir=None, devices=jax.devices()[:1])
    source = RolloutSource(trainer)
    it, state = source.iterator(), trainer.state
    source.follow(state)
    batch = next(it)
    _check_rows(source, state.params, batch)
    state, first = trainer.train_fn(state, trainer.to_global(batch))
    params = _copy(state.params)
    assert next(it) is batch  # updates_per_rollout=2: the same rollout again
    state, second = trainer.train_fn(state, trainer.to_global(batch))
    return batch, [_copy(first), _copy(second)], params, trainer


def _check_rows(source: RolloutSource, params, batch: dict) -> None:
    """Each row is its prompt then the sampler's completion, marked; the rollout's old
    log-probabilities (a training forward) are the sampler's own log-probabilities."""
    G, new = source.s.num_generations, source.s.max_new_tokens
    prompts = source.prompts.take(0, len(batch["tokens"]) // G)
    out = source.sampler(params, [p.ids for p in prompts], jax.random.fold_in(source.key, 0),
                         new)
    tokens, lengths, logprobs = (np.asarray(x) for x in (out.tokens, out.lengths,
                                                          out.logprobs))
    for r, row in enumerate(batch["tokens"]):
        ids, n = prompts[r // G].ids, lengths[r]
        assert row[:len(ids)].tolist() == list(ids)
        assert row[len(ids):len(ids) + n].tolist() == tokens[r, :n].tolist()
        assert batch["loss_mask"][r].tolist() == [len(ids) <= t < len(ids) + n
                                                  for t in range(len(row))]
        np.testing.assert_allclose(batch["old_logp"][r, len(ids) - 1:len(ids) - 1 + n],
                                   logprobs[r, :n], atol=2e-5)


def test_step_loss_equals_policy_loss_on_independent_logps(one_device):
    batch, (first, second), params, trainer = one_device
    mask = batch["loss_mask"][:, 1:] > 0
    assert mask.any(axis=1).all() and np.ptp(batch["advantages"]) > 0
    s = trainer.ctx.objective.settings
    model_def = trainer.ctx.model_def

    def loss(p):
        logits = model_def.module(p)(jnp.asarray(batch["tokens"][:, :-1]))
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1),
                                   jnp.asarray(batch["tokens"][:, 1:, None]), -1)[..., 0]
        return policy_loss(logp, jnp.asarray(batch["old_logp"]), jnp.asarray(batch["ref_logp"]),
                           jnp.asarray(batch["advantages"]), jnp.asarray(mask),
                           row_weights(jnp.asarray(mask), s.loss_norm, s.max_new_tokens),
                           epsilon=s.epsilon, epsilon_high=s.epsilon_high, beta=s.beta)

    (want, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params)
    assert float(metrics["kl"]) > 1e-6 and float(metrics["clip_fraction"]) > 0  # not trivial
    assert float(second["loss"]) == pytest.approx(float(want), rel=1e-4, abs=1e-6)
    for name in ("kl", "clip_fraction"):
        assert float(second[name]) == pytest.approx(float(metrics[name]), rel=1e-4, abs=1e-7)
    norm = float(jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))))
    assert float(second["grad_norm"]) == pytest.approx(norm, rel=1e-4)
    # The rollout scored the old policy with the sampler's weights: the first update's
    # ratios are 1 (nothing clipped) and its KL to the reference (the same weights) is 0.
    assert float(first["clip_fraction"]) == 0.0 and abs(float(first["kl"])) < 1e-6


@pytest.mark.parametrize("layout", [
    dict(mesh=dict(data=2, fsdp=2, tensor=2), grad_accum=2),
    pytest.param(dict(mesh=dict(data=2, pipeline=2, fsdp=2), microbatches=2),
                 marks=pytest.mark.exhaustive),
], ids=["fsdp_tensor_accum", "gpipe"])
def test_update_on_fsdp_and_tensor_equals_one_device(toy, one_device, layout):
    batch, (_, one), _, _ = one_device
    toy.mesh.update(layout["mesh"])
    toy.rules_preset = "fsdp_tp" if "tensor" in layout["mesh"] else "fsdp"
    toy.train.grad_accum = layout.get("grad_accum", 1)
    toy.pipeline.microbatches = layout.get("microbatches", 1)
    sharded = Trainer.build(toy, workdir=None)
    assert all(sharded.ctx.mesh.shape[k] == v for k, v in layout["mesh"].items())
    state, first = sharded.train_fn(sharded.state, sharded.to_global(batch))
    state, two = sharded.train_fn(state, sharded.to_global(batch))
    for name in ("loss", "kl", "clip_fraction", "grad_norm"):
        assert float(two[name]) == pytest.approx(float(one[name]), rel=2e-4, abs=1e-6), name


def _losses(workdir: str) -> dict[int, float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {m["step"]: m["loss"] for m in map(json.loads, f) if "loss" in m}


def test_resume_between_two_updates_of_a_rollout_is_exact(toy, tmp_path):
    toy.train.steps = 3  # rollout 0 for steps 1-2, rollout 1 for step 3
    toy.checkpoint.every = 1
    trainer = prepare_grpo(toy, str(tmp_path / "whole"))
    trainer.run()
    assert trainer.batches.held_out.sampler is None  # train.eval_every=0: no eval decoding
    # Stopped after step 1: its checkpoint holds rollout 0's batch for step 2.
    parts = tmp_path / "parts"
    (parts / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "whole" / "checkpoints" / "1", parts / "checkpoints" / "1")
    prepare_grpo(toy, str(parts)).run()
    whole, resumed = _losses(str(tmp_path / "whole")), _losses(str(parts))
    assert sorted(whole) == [1, 2, 3] and sorted(resumed) == [2, 3]
    assert [resumed[k] for k in (2, 3)] == [whole[k] for k in (2, 3)]
    with open(tmp_path / "whole" / "metrics.jsonl") as f:
        logged = [m for m in map(json.loads, f) if "loss" in m]
    reported = ("reward_mean", "reward_std", "reward/digits", "zero_std_fraction", "kl",
                "clip_fraction", "completion_length", "completion_length_max",
                "truncated_fraction", "rollout_tokens_per_s", "rollout_s", "update_s")
    assert all(name in logged[i] for i in (0, 2) for name in reported), logged  # rollouts
    assert logged[0]["completion_length_max"] <= toy.objective.max_new_tokens
    assert "reward_mean" not in logged[1] and "update_s" in logged[1]  # step 1's rollout again
    assert not any(k.startswith("eval_") for m in logged for k in m)


@pytest.mark.slow
def test_toy_task_reward_rises(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rewards = [m["reward_mean"] for m in run_toy(12, str(tmp_path))]
    assert rewards[0] < 0.3 and rewards[-1] > 0.9, rewards


# --- bad reward functions and settings: one paragraph each ---------------------------------
def _module(tmp_path, monkeypatch, body: str) -> str:
    name = f"rewards_{abs(hash(body)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_reward_spec_errors(tmp_path, monkeypatch):
    with pytest.raises(RewardError, match="no module 'no_such_rewards'"):
        load_rewards("no_such_rewards:fn")
    name = _module(tmp_path, monkeypatch, "import no_such_dependency\n")
    with pytest.raises(RewardError, match="failed inside it"):
        load_rewards(f"{name}:fn")
    name = _module(tmp_path, monkeypatch, "x = 1\n")
    with pytest.raises(RewardError, match="has no function 'fn'"):
        load_rewards(f"{name}:fn")
    with pytest.raises(ConfigError, match="not module:function"):
        load_rewards(f"{name}:fn@heavy")
    with pytest.raises(ConfigError, match=r"weighs its reward by 0: .* nothing trains"):
        load_rewards(f"{name}:fn@0")


@pytest.mark.parametrize("body,message", [
    ("return [1.0]", "returned 1 values for 3 completions"),
    ("return [1.0, 'yes', 0.0]", "'yes' .str. for completion 1, not a number"),
    ("return [1.0, None, 0.0]", "None .NoneType. for completion 1"),
    ("return [float('nan')] * 3", "returned nan for completion 0"),
    ("return 1.0", "returned float, not a list"),
    ("raise KeyError('answer')", "raised KeyError"),
])
def test_reward_result_errors(tmp_path, monkeypatch, body, message):
    name = _module(tmp_path, monkeypatch, f"def fn(prompts, completions, records):\n    {body}\n")
    rewards = load_rewards(f"{name}:fn")
    with pytest.raises(RewardError, match=message):
        score(rewards, ["p"] * 3, ["a", "b", "c"], [{}] * 3)


def test_rewards_are_weighted_and_reported_per_function(tmp_path, monkeypatch):
    name = _module(tmp_path, monkeypatch, "def one(p, c, r):\n    return [1] * len(c)\n"
                   "def length(p, c, r):\n    return [len(x) for x in c]\n")
    total, each = score(load_rewards(f"{name}:one@0.5,{name}:length@2"), ["p"] * 2,
                        ["ab", "abcd"], [{}] * 2)
    np.testing.assert_allclose(total, [4.5, 8.5])
    assert sorted(each) == ["length", "one"]


@pytest.mark.parametrize("change,message", [
    (dict(loss_norm="mean"), "loss_norm='mean' is not one of token, sequence, constant"),
    (dict(scale_rewards="std"), "scale_rewards='std'"),
    (dict(ratio_level="row"), "ratio_level='row'"),
    (dict(num_generations=3), "not a multiple of objective.num_generations=3"),
    (dict(num_generations=1), "at least 2 completions"),
    (dict(temperature=0.0), "temperature=0.0 must be > 0"),
    (dict(beta=-0.1), "beta=-0.1 must be >= 0"),
    (dict(max_new_tokens=32), "max_new_tokens=32 must be in"),
    (dict(updates_per_rollout=0), "updates_per_rollout=0"),
    (dict(rewards=""), "objective.rewards is empty"),
])
def test_settings_errors(toy, change, message):
    toy.objective.update(change)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        config_lib.validate(toy)


def test_grpo_needs_prompts_and_prompts_need_grpo(toy, tmp_path):
    (tmp_path / "t.txt").write_text("some text\n")
    text = toy.copy_and_resolve_references()
    text.data.sources = f"text={tmp_path}/t.txt"
    with pytest.raises(ConfigError, match="samples completions of prompts, but data.sources"):
        config_lib.validate(text)
    toy.objective.name = "lm"
    with pytest.raises(ConfigError, match="prompts=GLOB, which objective.name='lm' cannot"):
        config_lib.validate(toy)


def test_1f1b_is_refused(toy):
    toy.mesh.update(data=1, pipeline=2)
    toy.pipeline.update(schedule="1f1b", microbatches=2)
    with pytest.raises(ConfigError, match="pipeline.schedule='1f1b' runs a"):
        config_lib.validate(toy)


# --- prompts: plain text, chat messages through the template, bad records ---------------
def test_chat_prompts_render_as_transformers_and_stop_at_the_end_of_turn(tmp_path):
    transformers = pytest.importorskip("transformers")
    from chat_common import tokenizer_dir
    from jaxscale.config import base_config
    from jaxscale.data.prompts import PromptSet
    from jaxscale.rl.rollout import stop_ids

    directory = tokenizer_dir(str(tmp_path), "qwen2")
    messages = [{"role": "user", "content": "what is two plus two"}]
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": messages, "answer": "four"}) + "\n"
                                      + json.dumps({"prompt": "hello world"}) + "\n")
    c = base_config()
    c.data.update(sources=f"prompts={tmp_path}/p.jsonl", tokenizer=directory)
    chat, plain = PromptSet(c, 64).prompts
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert list(chat.ids) == theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)
    assert chat.chat and chat.record["answer"] == "four" and not plain.chat
    ours = PromptSet(c, 64).tokenizer  # plain text: after the tokenizer's BOS
    assert list(plain.ids) == [ours.bos_id] + theirs("hello world",
                                                     add_special_tokens=False)["input_ids"]
    assert theirs.convert_tokens_to_ids("<|im_end|>") in stop_ids(ours)


@pytest.mark.parametrize("line,message", [
    ('{"question": "2+2"}', "line 1 has no \"prompt\""),
    ('{"prompt": ""}', "line 1 has no \"prompt\""),
    ('{"prompt": "' + "x" * 40 + '"}', "the prompt is 40 tokens, but a row holds at most 20"),
    ("not json", "line 1 is not JSON"),
])
def test_bad_prompt_records_are_one_paragraph(tmp_path, line, message):
    from jaxscale.config import base_config
    from jaxscale.data.prompts import PromptSet
    from jaxscale.data.readers import DataError

    (tmp_path / "p.jsonl").write_text(line + "\n")
    c = base_config()
    c.data.sources = f"prompts={tmp_path}/p.jsonl"
    with pytest.raises(DataError, match=message):
        PromptSet(c, 20)


def test_prompt_order_is_a_seeded_shuffle_per_pass(tmp_path):
    from jaxscale.config import base_config
    from jaxscale.data.prompts import PromptSet

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n"
                                              for i in range(6)))
    c = base_config()
    c.data.sources = f"prompts={tmp_path}/p.jsonl"
    prompts = PromptSet(c, 20)
    names = lambda rollout: [p.prompt for p in prompts.take(rollout, 3)]
    assert sorted(names(0) + names(1)) == [f"q{i}" for i in range(6)]  # one pass: each once
    assert sorted(names(2) + names(3)) == [f"q{i}" for i in range(6)]  # the next pass
    assert names(2) + names(3) != names(0) + names(1)  # reshuffled
    assert [p.prompt for p in PromptSet(c, 20).take(3, 3)] == names(3)  # fixed by the seed


def test_processes_with_other_prompts_are_refused(tmp_path):
    """A multi-host run compares every process's `PromptSet.digest` (gathered) before sampling."""
    from jaxscale.config import base_config
    from jaxscale.data.prompts import PromptSet
    from jaxscale.rl.rollout import check_same_prompts

    def digest(lines: list[str]) -> np.ndarray:
        path = tmp_path / f"p{abs(hash(tuple(lines)))}.jsonl"
        path.write_text("".join(json.dumps({"prompt": line}) + "\n" for line in lines))
        c = base_config()
        c.data.sources = f"prompts={path}"
        return PromptSet(c, 20).digest()

    same = digest(["q0", "q1"])
    check_same_prompts(np.stack([same, digest(["q0", "q1"])]), "prompts=p.jsonl")
    for other in (["q0", "q2"], ["q1", "q0"], ["q0", "q1", "q2"]):
        with pytest.raises(ConfigError, match=r"other prompts on process 1 \(of 2; \d prompts"):
            check_same_prompts(np.stack([same, digest(other)]), "prompts=p.jsonl")
