"""`launch.evaluate --eval_sources`: loss / perplexity on any text files with the run's
tokenizer, every real token counted once whatever the batch size (the last batch is padded with
masked rows), equal to running the model on each document alone."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs.tiny_lm import get_config
from jaxscale.errors import ConfigError
from jaxscale.inference.evaluate import evaluate_params
from jaxscale.models import ModelDef
from jaxscale.precision import get_policy

TEXTS = ["def main():", "import os", "print('hello world')", "x = 1 + 2", "class A: pass",
         "return None", "for i in range(3):", "while True: break", "a, b = b, a",
         "assert x == 3", "lambda y: y * 2", "with open(p) as f:", "try: pass",
         "raise ValueError", "yield from it", "del x"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaltext")
    for i, t in enumerate(TEXTS[:5]):
        (root / f"{i}.txt").write_text(t)
    (root / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[5:]))
    c = get_config("test")
    c.data.update(packing="pack", seq_len=32, batch_size=8)
    params = ModelDef.build(c.model, get_policy(c.precision)).init_params(jax.random.key(1))
    return root, c, jax.device_get(params)


def _alone(c, params, texts: list[str]) -> tuple[float, int]:
    """Summed next-token loss of each document run by itself (bytes + EOS 0; causal, so the
    padding after a document changes nothing before it), and the count of predicted tokens."""
    model_def = ModelDef.build(c.model, get_policy(c.precision))
    docs = [list(t.encode()) + [0] for t in texts]
    width = max(map(len, docs))
    ids = jnp.asarray([d + [0] * (width - len(d)) for d in docs], jnp.int32)
    mask = jnp.asarray([[1.0] * (len(d) - 1) + [0.0] * (width - len(d)) for d in docs])
    logits = jax.jit(lambda p, x: model_def.module(p)(x))(params, ids[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                            ids[:, 1:])
    return float((losses * mask).sum()), int(mask.sum())


def test_loss_on_text_files_equals_each_document_alone_for_any_batch_size(setup):
    root, c, params = setup
    sources = f"text={root}/*.txt;jsonl={root}/more.jsonl"
    got = evaluate_params(c, params, eval_sources=sources)
    c16 = c.copy_and_resolve_references()
    c16.data.batch_size = 16  # one batch with masked padding rows instead of several
    other = evaluate_params(c16, params, eval_sources=sources)
    loss_sum, count = _alone(c, params, TEXTS)
    want = loss_sum / count
    assert got["tokens"] == other["tokens"] == count
    assert got["loss"] == pytest.approx(want, rel=1e-4)
    assert other["loss"] == pytest.approx(got["loss"], rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-6)


def test_concat_rows_pad_the_last_batch_with_masked_rows(setup):
    from jaxscale.data.mixture import source_eval_batches
    root, c, _ = setup
    c = c.copy_and_resolve_references()
    c.data.update(packing="concat", seq_len=8, batch_size=8)
    batches = source_eval_batches(c, f"text={root}/*.txt", 0, 2)  # this host's 4 rows of 8
    total = sum(len(t.encode()) + 1 for t in TEXTS[:5])
    rows = (total - 1) // 8
    assert all(b["tokens"].shape == (4, 9) for b in batches)
    mask = np.concatenate([b["mask"] for b in batches] +
                          [b["mask"] for b in source_eval_batches(c, f"text={root}/*.txt", 1, 2)])
    assert mask.sum() == rows and len(mask) % 8 == 0 and len(mask) - rows < 8


def test_bad_eval_sources_are_clear_errors(setup, tmp_path):
    root, c, params = setup
    with pytest.raises(ConfigError, match="matches no file"):
        evaluate_params(c, params, eval_sources=f"text={tmp_path}/none/*.txt")
    with pytest.raises(ConfigError, match="FORMAT=GLOB"):
        evaluate_params(c, params, eval_sources=f"{root}/*.txt")
    (tmp_path / "tiny.txt").write_text("a")
    c = c.copy_and_resolve_references()
    c.data.packing = "concat"
    with pytest.raises(ConfigError, match="too short"):
        evaluate_params(c, params, eval_sources=f"text={tmp_path}/tiny.txt")


def test_a_bad_record_names_the_flag_that_skips_it_and_skipping_drops_only_it(setup, tmp_path):
    from jaxscale.data.readers import DataError
    root, c, params = setup
    good = [json.dumps({"text": t}) for t in TEXTS[5:]]
    (tmp_path / "bad.jsonl").write_text("\n".join(good[:3] + ["not json"] + good[3:]) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl line 4 .*--skip_bad_records \(evaluate"):
        evaluate_params(c, params, eval_sources=f"jsonl={tmp_path}/bad.jsonl")
    skipping = c.copy_and_resolve_references()
    skipping.data.skip_bad_records = True  # what `evaluate --skip_bad_records` sets
    got = evaluate_params(skipping, params, eval_sources=f"jsonl={tmp_path}/bad.jsonl")
    want = evaluate_params(c, params, eval_sources=f"jsonl={root}/more.jsonl")
    assert got["tokens"] == want["tokens"] and got["loss"] == pytest.approx(want["loss"])


def test_eval_sources_of_another_kind_than_the_objective_scores(setup):
    """Training's own check (`objectives.check_data_kind`), blaming --eval_sources; evaluate
    scores rows and samples nothing, so prompts are refused even for a grpo run, which is
    scored on text."""
    from jaxscale.errors import JaxscaleError
    root, c, params = setup
    sources = f"preference={root}/more.jsonl"
    with pytest.raises(JaxscaleError, match=rf"--eval_sources={re.escape(sources)} holds preference pairs, "
                                            r"which objective.name='lm' cannot score"):
        evaluate_params(c, params, eval_sources=sources)
    dpo = c.copy_and_resolve_references()
    dpo.objective.name = "dpo"
    with pytest.raises(JaxscaleError, match=r"'dpo' trains on preference pairs, but "
                                            r"--eval_sources=jsonl=.* holds text data"):
        evaluate_params(dpo, params, eval_sources=f"jsonl={root}/more.jsonl")
    grpo = c.copy_and_resolve_references()
    grpo.objective.update(name="grpo", beta=0.0)
    with pytest.raises(JaxscaleError, match=r"holds prompts=GLOB, which objective.name='grpo' "
                                            r"cannot score .* drop the flag"):
        evaluate_params(grpo, params, eval_sources=f"prompts={root}/more.jsonl")
    text = f"jsonl={root}/more.jsonl"  # a grpo policy on text: the model's own held-out loss
    assert evaluate_params(grpo, params, eval_sources=text) == evaluate_params(
        c, params, eval_sources=text)
