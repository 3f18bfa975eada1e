"""One held-out loss (`jaxscale.train.heldout`): the loop's `eval_loss` in `metrics.jsonl` is what
`jaxscale evaluate --workdir` says of the same step, for a model whose training loss is not a
held-out loss (MoE: router losses) on data whose rows are not all targets (packed files:
padding and document boundaries)."""

import json
import random

import jax
import numpy as np
import pytest

from configs import tiny_lm
from jaxscale.inference.evaluate import evaluate_workdir
from jaxscale.observe.metrics import read_metrics
from jaxscale.rules import use_rules
from jaxscale.train.loop import prepare
from jaxscale.train.step import loss_and_metrics

WORDS = "the quick brown fox jumps over lazy dog data model token train jax grain".split()


def test_loop_eval_loss_is_jaxscale_evaluate_for_moe_on_packed_files(tmp_path):
    rng = random.Random(0)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    c = tiny_lm.get_config("test")
    c.model.moe.update(num_experts=4, experts_per_token=2, router_aux_loss_coef=0.5,
                       router_z_loss_coef=0.1)
    c.data.update(sources=f"jsonl={tmp_path}/docs.jsonl", tokenizer="bytes", packing="pack",
                  eval_fraction=0.2, eval_batches=2)
    c.train.update(steps=4, log_every=2, eval_every=4)
    c.checkpoint.every = 4
    workdir = str(tmp_path / "run")
    trainer = prepare(c, workdir)
    state = trainer.run()

    logged = [m for m in read_metrics(workdir) if m.get("eval_loss") is not None]
    assert [m["step"] for m in logged] == [4]
    got = evaluate_workdir(workdir)
    assert abs(logged[-1]["eval_loss"] - got["loss"]) <= 1e-5
    assert abs(logged[-1]["eval_accuracy"] - got["accuracy"]) <= 1e-6
    assert logged[-1]["eval_perplexity"] == pytest.approx(np.exp(got["loss"]), rel=1e-5)

    # The data and model make the two definitions differ: packed rows with padding, and router
    # losses (aux >= 1 per MoE layer, weighed 0.5) in the per-batch training loss that the
    # loop used to average.
    eval_data = trainer.eval_data
    assert "segment_ids" in eval_data[0] and (eval_data[0]["segment_ids"] == 0).any()
    ctx = trainer.ctx

    @jax.jit
    def training_loss(params, batch):
        with use_rules(ctx.rules, ctx.mesh):
            return loss_and_metrics(params, state.frozen, batch, ctx.model_def)[0]

    old = np.mean([float(training_loss(state.params, trainer.to_global(b))) for b in eval_data])
    assert old - got["loss"] > 0.4
