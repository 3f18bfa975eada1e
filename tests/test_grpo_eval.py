"""A `grpo` run's held-out rewards (`train.eval_every`): the held-out prompt split and the
greedy evaluation the loop logs.

The toy run (two steps, an evaluation after each) logs `eval_reward_mean` and friends equal to
an independent computation: the held-out prompts decoded greedily here by the model's plain
forward (no KV cache, no sampler: the argmax of the last prompt position's logits, appended,
again), the reward functions called directly, averaged. The split is checked on the prompt
records alone: disjoint from the training prompts, all records covered, the same whatever the
files' order, and an empty side is one paragraph.
"""

from __future__ import annotations

import json
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.grpo_toy import toy_config
from jaxscale.config import base_config
from jaxscale.data.prompts import record_key, training_and_heldout
from jaxscale.errors import ConfigError
from jaxscale.rl.rollout import prepare_grpo, stop_ids

CODE_REWARD = '''def code(prompts, completions, records):
    """Reads the record: the completion's mean code point (/256) plus the record's id / 100."""
    return [sum(min(ord(ch), 256) for ch in c) / max(len(c), 1) / 256 + r["id"] / 100
            for c, r in zip(completions, records)]
'''


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """(the trainer after a 2-step toy run evaluating after each step, its logged metrics)."""
    directory = tmp_path_factory.mktemp("grpo_eval")
    (directory / "eval_reward.py").write_text(CODE_REWARD)
    c = toy_config(str(directory), steps=2)
    c.data.update(batch_size=16, eval_fraction=0.35, eval_batches=2)  # 17 held out: 2 chunks
    c.objective.update(num_generations=4, rewards="toy_reward:digits,eval_reward:code@0.5")
    c.train.eval_every = 1
    sys.path.insert(0, str(directory))
    try:
        trainer = prepare_grpo(c, str(directory / "run"))
        trainer.run()
        import eval_reward
        import toy_reward
    finally:
        sys.path.remove(str(directory))
    with open(directory / "run" / "metrics.jsonl") as f:
        logged = {m["step"]: m for m in map(json.loads, f) if "loss" in m}
    return trainer, logged, (toy_reward.digits, eval_reward.code)


def _greedy(model_def, params, prompts: list[tuple[int, ...]], stops, new: int, width: int
            ) -> tuple[list[list[int]], list[bool]]:
    """Each prompt's greedy completion by full forwards (right-padded, causal), and whether it
    ended at a stop id."""
    forward = jax.jit(lambda p, t: model_def.module(p)(t))
    rows = np.zeros((len(prompts), width), np.int32)
    for r, p in enumerate(prompts):
        rows[r, :len(p)] = p
    ends, out = [len(p) for p in prompts], [[] for _ in prompts]
    stopped = [False] * len(prompts)
    for _ in range(new):
        logits = np.asarray(forward(params, jnp.asarray(rows)), np.float32)
        for r in range(len(prompts)):
            if not stopped[r]:
                token = int(np.argmax(logits[r, ends[r] - 1]))
                out[r].append(token)
                rows[r, ends[r]], ends[r] = token, ends[r] + 1
                stopped[r] = token in stops
    return out, stopped


def test_eval_reward_equals_an_independent_greedy_decode(toy_run):
    trainer, logged, (digits, code) = toy_run
    source = trainer.batches
    held = source.held_out.prompts
    config = trainer.config
    assert 16 < len(held) <= config.data.eval_batches * config.data.batch_size  # 2 chunks
    trained = {record_key(p.record) for p in source.prompts.prompts}
    assert not trained & {record_key(p.record) for p in held}
    assert len(trained) + len(held) == 64

    tok, new = source.tokenizer, config.objective.max_new_tokens
    stops = stop_ids(tok)
    tokens, stopped = _greedy(trainer.ctx.model_def, trainer.state.params,
                              [p.ids for p in held], stops, new, config.data.seq_len)
    texts = [tok.decode(t[:-1] if t and t[-1] in stops else t) for t in tokens]
    prompts, records = [p.prompt for p in held], [p.record for p in held]
    each = {"digits": np.mean(digits(prompts, texts, records)),
            "code": np.mean(code(prompts, texts, records))}
    m = logged[2]  # the evaluation of the final state
    assert m["eval_reward/code"] == pytest.approx(each["code"], rel=1e-9) and each["code"] > 0
    assert m["eval_reward/digits"] == pytest.approx(each["digits"], abs=1e-9)
    assert m["eval_reward_mean"] == pytest.approx(each["digits"] + 0.5 * each["code"], rel=1e-9)
    assert m["eval_completion_length"] == pytest.approx(np.mean([len(t) for t in tokens]))
    assert m["eval_truncated_fraction"] == pytest.approx(1 - np.mean(stopped))
    assert all(k in logged[1] for k in m if k.startswith("eval_"))  # step 1 evaluated too
    # Two evaluations of two chunks each (the second filled): one program.
    assert source.held_out.sampler.compiles() == 1


def _prompts(path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _config(sources: str, fraction: float = 0.25, eval_every: int = 10):
    c = base_config()
    c.data.update(sources=sources, eval_fraction=fraction)
    c.train.eval_every = eval_every
    return c


def test_hash_split_is_disjoint_and_does_not_depend_on_file_order(tmp_path):
    records = [{"prompt": f"question {i}", "answer": str(i)} for i in range(40)]
    _prompts(tmp_path / "all.jsonl", records)
    train, held = training_and_heldout(_config(f"prompts={tmp_path}/all.jsonl"), 20)
    keys = lambda prompts: {record_key(p.record) for p in prompts}
    assert 0 < len(held) < 40 and not keys(train.prompts) & keys(held)
    assert keys(train.prompts) | keys(held) == {record_key(r) for r in records}
    # Shuffled records, keys in another order, split over two files: the same split.
    shuffled = [dict(reversed(r.items())) for r in random.Random(0).sample(records, 40)]
    _prompts(tmp_path / "b1.jsonl", shuffled[:13])
    _prompts(tmp_path / "b2.jsonl", shuffled[13:])
    train2, held2 = training_and_heldout(_config(f"prompts={tmp_path}/b*.jsonl"), 20)
    assert keys(held2) == keys(held) and keys(train2.prompts) == keys(train.prompts)
    # A pass over the training prompts draws each once and never a held-out one.
    drawn = [p for k in range(len(train) // 3) for p in train.take(k, 3)]
    assert len(keys(drawn)) == len(drawn) and keys(drawn) <= keys(train.prompts)
    # data.eval_sources names the held-out prompts: every record of data.sources trains.
    _prompts(tmp_path / "held.jsonl", [{"prompt": "held out", "id": 0}])
    c = _config(f"prompts={tmp_path}/all.jsonl")
    c.data.eval_sources = f"prompts={tmp_path}/held.jsonl"
    train3, held3 = training_and_heldout(c, 20)
    assert len(train3) == 40 and [p.record for p in held3] == [{"prompt": "held out", "id": 0}]


def test_an_empty_side_of_the_split_is_one_paragraph(tmp_path):
    _prompts(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    _prompts(tmp_path / "empty.jsonl", [])
    sources = f"prompts={tmp_path}/p.jsonl"
    cases = [
        (_config(sources, 0.0, 5), "train.eval_every=5 decodes the held-out prompts, but "
         "data.eval_fraction=0.0 of the 2 prompt records"),
        (_config(sources, 0.99999, 0), "holds out every record"),
    ]
    c = _config(sources)
    c.data.eval_sources = f"prompts={tmp_path}/empty.jsonl"
    cases.append((c, "data.eval_sources=.* holds no prompt record"))
    for config, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            training_and_heldout(config, 20)
        assert "\n" not in str(error.value) and "data.eval_" in str(error.value)
    train, held = training_and_heldout(_config(sources, 0.0, 0), 20)  # no eval: all train
    assert len(train) == 2 and held == []
