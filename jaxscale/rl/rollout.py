"""GRPO's rollouts: the batches a `grpo` run trains on, sampled with the weights being trained.

A `RolloutSource` takes the place of the data pipeline in the training loop (`Trainer.batches`):
the loop hands it the state it trains (`follow`) and pulls a batch per step. A new rollout, on
the training mesh and with the training rules:

  1. takes P = data.batch_size / G prompts (`data/prompts.py`: an order fixed by the seed);
  2. samples G completions of each with the rollout sampler (`inference/sampling.py`), stopping
     at the tokenizer's EOS / end-of-turn, with the key `fold_in(key(seed), rollout number)`;
  3. lays each (prompt, completion) in a row of data.seq_len + 1 tokens, the completion marked,
     and scores it with one forward pass: the policy's log-probabilities now (`old_logp`, the
     ratio's denominator for every update of this rollout) and, with beta > 0, the reference's;
  4. decodes the completions and calls the reward functions (`rewards.py`) on the whole batch,
     then takes the group advantages (`objectives/grpo.py`).

On several processes (a multi-host run) every process reads the same prompts (checked once:
`check_same_prompts`) and builds the same whole rollout batch, the simplest layout that is
correct: the sampler takes the prompts as a replicated input on the global mesh, its tokens and
the scored log-probabilities are gathered to every process, process 0 alone calls the reward
functions and broadcasts their rewards (`rewards.score_everywhere`: a non-deterministic reward
cannot make hosts disagree), and `Trainer.to_global` takes each process's rows of the batch.

The batch is then trained on `objective.updates_per_rollout` times (one optimizer step each).
Resuming is exact: the prompts and the sampling key of a rollout derive from (seed, rollout
number), the weights it samples with are the checkpoint's, and a checkpoint taken between two
updates of one rollout carries that rollout's batch in its data state (a checkpoint.every that
is a multiple of updates_per_rollout never needs to). The run's metrics (`metrics()`, logged
with the step's) are the means over the rollouts since the last log, with the seconds spent in
rollouts (`rollout_s`: sampling, scoring and rewards) and in updates (`update_s`).

Held-out rewards (`HeldOutRewards`): the prompts `data/prompts.py` holds out (`data.eval_sources`
or a stable-hash `data.eval_fraction` of the records, never trained on) are decoded greedily at
each `train.eval_every` and scored by the same reward functions; `Trainer.evaluate` asks the
batch source for them (`evaluate`), as it asks it to `follow` the state and for its `metrics`.
"""

from __future__ import annotations

import base64
import io
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from jax.experimental import multihost_utils

from jaxscale.data.prompts import Prompt, digest, training_and_heldout
from jaxscale.errors import ConfigError, paragraph
from jaxscale.inference.sampling import Sampler, Sampling
from jaxscale.objectives import Settings
from jaxscale.objectives.grpo import group_advantages
from jaxscale.rl.rewards import load_rewards, score_everywhere
from jaxscale.rules import use_rules
from jaxscale.train.loop import Trainer, prepare
from jaxscale.train.state import TrainState
from jaxscale.weights.tree import merge_trees

SALT = 0x5EED  # sampling keys: fold_in(fold_in(key(seed), SALT), rollout)
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def stop_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's EOS and any end-of-turn token it has."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    ids |= {i for i in map(tokenizer.token_id, END_OF_TURN) if i is not None}
    return tuple(sorted(ids))


def check_same_prompts(digests_PD: np.ndarray, sources: str, field: str = "data.sources"
                       ) -> None:
    """Every process must have read the same prompts (`PromptSet.digest`, one row a process):
    each builds the whole rollout batch from them, and the sampler takes its prompts as the
    same (replicated) input on every process, so a host with other files would corrupt it."""
    differ = [p for p in range(1, len(digests_PD))
              if not np.array_equal(digests_PD[p], digests_PD[0])]
    if differ:
        raise ConfigError(paragraph(
            f"{field}={sources!r} holds other prompts on process {differ[0]} (of",
            f"{len(digests_PD)}; {int(digests_PD[differ[0]][0])} prompts) than on process 0",
            f"({int(digests_PD[0][0])} prompts): every process builds the whole rollout batch",
            "from them, so all must read the same records. Put the prompts where every host",
            "reads the same files (gs://, s3://, a shared filesystem), or copy them alike."))


def _fetch(tree: Any) -> Any:
    """`tree`'s global arrays whole, as numpy, on every process (gathered from the processes
    that hold their shards; on one process, `device_get`)."""
    return multihost_utils.process_allgather(tree, tiled=True)


def _pack(batch: dict[str, np.ndarray]) -> str:
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **batch)
    return base64.b64encode(buffer.getvalue()).decode()


def _unpack(text: str) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(base64.b64decode(text))) as f:
        return {k: f[k] for k in f.files}


class RolloutSource:
    """The batches of a `grpo` run (see the module docstring); also its own iterator."""

    def __init__(self, trainer: Trainer):
        config, ctx = trainer.config, trainer.ctx
        self.s = s = Settings.from_config(config.objective)
        self.rows, self.width = config.data.batch_size, config.data.seq_len + 1
        self.prompts, heldout = training_and_heldout(config,
                                                     config.data.seq_len - s.max_new_tokens)
        if jax.process_count() > 1:  # every process builds the whole batch from them
            both = multihost_utils.process_allgather(
                np.concatenate([self.prompts.digest(), digest(heldout)]))
            check_same_prompts(both[:, :5], config.data.sources)
            held = "eval_sources" if config.data.get("eval_sources") else "sources"
            check_same_prompts(both[:, 5:], config.data[held], f"data.{held}")
        self.rewards = load_rewards(s.rewards)
        tok = self.prompts.tokenizer
        self.tokenizer, self.stops = tok, stop_ids(tok)
        sampling = Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                            n=s.num_generations, stop_ids=self.stops, pad_id=tok.pad_id)
        self.sampler = Sampler(ctx.model_def, sampling, ctx.rules, ctx.mesh,
                               config.model.get("max_len", 0))
        self.ctx, self.to_global = ctx, trainer.to_global
        self.held_out = HeldOutRewards(
            self, heldout[:config.data.eval_batches * config.data.batch_size],
            config.model.get("max_len", 0))
        self.key = jax.random.fold_in(jax.random.key(config.seed), SALT)
        self._score = self._scorer()
        self.state: TrainState | None = None
        self.position, self.cached = 0, None
        self._window: list[dict[str, float]] = []
        self._mark: float | None = None
        self._update_s = 0.0

    def _scorer(self) -> Any:
        """A jitted (params, reference weights, global batch) -> (policy log-probs, reference
        log-probs or None), each (B, T), on the training mesh."""
        ctx, task = self.ctx, self.ctx.model_def.task
        ref_def = None if ctx.reference is None else ctx.reference.model_def

        @jax.jit
        def scores(params: Any, reference: Any, batch: dict) -> tuple[jax.Array, Any]:
            with use_rules(ctx.rules, ctx.mesh):
                logp = task.token_logps(ctx.model_def.module(params), batch)[0]
                ref = (None if ref_def is None
                       else task.token_logps(ref_def.module(reference), batch)[0])
            return logp, ref

        return scores

    # --- what the loop calls ---------------------------------------------------------------
    def follow(self, state: TrainState) -> None:
        """The state the next rollout samples with (the loop's, after each step's hooks)."""
        self.state = state

    def iterator(self, state: dict | None = None) -> "RolloutSource":
        """Itself, at the position a checkpoint's data state names (the start without one)."""
        self.position, self.cached = 0, None
        if state:
            self.position = int(state.get("batches", 0))
            self.cached = _unpack(state["rollout"]) if state.get("rollout") else None
        return self

    def get_state(self) -> dict:
        """Batches handed out, and the rollout batch while updates of it remain."""
        state: dict[str, Any] = {"batches": self.position}
        if self.position % self.s.updates_per_rollout and self.cached is not None:
            state["rollout"] = _pack(self.cached)
        return state

    def __iter__(self) -> "RolloutSource":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self.position % self.s.updates_per_rollout == 0 or self.cached is None:
            self.cached = self._rollout(self.position // self.s.updates_per_rollout)
        self.position += 1
        return self.cached

    def evaluate(self, state: TrainState) -> dict[str, float]:
        """The held-out rewards of `state`'s weights (`HeldOutRewards.metrics`), which the loop
        logs as `eval_<name>` (`Trainer.evaluate` asks this source for them)."""
        params = merge_trees(state.params, state.frozen) if state.frozen else state.params
        return self.held_out.metrics(params)

    def metrics(self) -> dict[str, float]:
        """The means over the rollouts since the last call, and the time split."""
        self._count_updates()
        window, self._window = self._window, []
        if not window:
            return {"update_s": self._take_update_s()}
        out = {k: float(np.mean([w[k] for w in window])) for k in window[0]}
        out["completion_length_max"] = max(w["completion_length_max"] for w in window)
        for k in ("rollout_s", "sample_s", "rollout_tokens"):
            out[k] = float(sum(w[k] for w in window))
        out["rollout_tokens_per_s"] = out.pop("rollout_tokens") / max(out.pop("sample_s"),
                                                                      1e-9)
        out["update_s"] = self._take_update_s()
        return out

    # --- one rollout ------------------------------------------------------------------------
    def _count_updates(self) -> None:
        now = time.perf_counter()
        if self._mark is not None:
            self._update_s += now - self._mark
        self._mark = now

    def _take_update_s(self) -> float:
        out, self._update_s = self._update_s, 0.0
        return out

    def _rollout(self, number: int) -> dict[str, np.ndarray]:
        if self.state is None:
            raise RuntimeError("RolloutSource: follow(state) must come before the first batch")
        state = self.state
        params = merge_trees(state.params, state.frozen) if state.frozen else state.params
        jax.block_until_ready(params)  # the update that made them counts as update time
        self._count_updates()
        began = time.perf_counter()
        G = self.s.num_generations
        prompts = self.prompts.take(number, self.rows // G)
        out = self.sampler(params, [p.ids for p in prompts],
                           jax.random.fold_in(self.key, number), self.s.max_new_tokens)
        tokens, lengths, stopped = _fetch((out.tokens, out.lengths, out.stopped))
        sample_s = time.perf_counter() - began
        batch = self._rows(prompts, tokens, lengths)
        reference = self.ctx.bound_reference(state)
        logp, ref = self._score(params, None if reference is None else reference[1],
                                self.to_global({k: batch[k] for k in ("tokens", "loss_mask")}))
        batch["old_logp"] = np.asarray(_fetch(logp), np.float32)
        if self.s.beta > 0:
            batch["ref_logp"] = np.asarray(_fetch(ref), np.float32)
        completions = [self._completion(prompts[r // G], tokens[r, :lengths[r]])
                       for r in range(len(tokens))]
        rows_of = lambda field: [getattr(prompts[r // G], field) for r in range(len(tokens))]
        total, per_function = score_everywhere(self.rewards, rows_of("prompt"), completions,
                                               rows_of("record"))
        advantages, std_P = group_advantages(jnp.asarray(total, jnp.float32), G,
                                             self.s.scale_rewards)
        batch["advantages"] = np.asarray(advantages, np.float32)
        self._window.append({
            "reward_mean": float(total.mean()), "reward_std": float(np.mean(std_P)),
            **{f"reward/{k}": float(v.mean()) for k, v in per_function.items()},
            "zero_std_fraction": float(np.mean(np.asarray(std_P) <= 1e-6)),
            "completion_length": float(lengths.mean()),
            "completion_length_max": float(lengths.max()),
            "truncated_fraction": float(1.0 - stopped.mean()),
            "rollout_s": time.perf_counter() - began, "sample_s": sample_s,
            "rollout_tokens": float(lengths.sum())})
        self._mark = time.perf_counter()
        return batch

    def _rows(self, prompts: list[Prompt], tokens: np.ndarray, lengths: np.ndarray
              ) -> dict[str, np.ndarray]:
        """Each (prompt, completion) right-padded to the row width, the completion marked."""
        G, pad = self.s.num_generations, self.tokenizer.pad_id
        rows = np.full((len(tokens), self.width), pad, np.int32)
        mask = np.zeros((len(tokens), self.width), np.int32)
        for r, n in enumerate(lengths):
            p = prompts[r // G].ids
            rows[r, :len(p)], rows[r, len(p):len(p) + n] = p, tokens[r, :n]
            mask[r, len(p):len(p) + n] = 1
        return {"tokens": rows, "loss_mask": mask}

    def _completion(self, prompt: Prompt, ids: np.ndarray) -> Any:
        """The decoded completion (without its stop token), in the prompt's form."""
        ids = [int(i) for i in ids]
        while ids and ids[-1] in self.stops:
            ids.pop()
        text = self.tokenizer.decode(ids)
        return [{"role": "assistant", "content": text}] if prompt.chat else text


class HeldOutRewards:
    """A `grpo` run's held-out metrics: each held-out prompt (at most data.eval_batches x
    data.batch_size of them, in file order) decoded GREEDILY (temperature 0, one completion,
    objective.max_new_tokens, the rollouts' stop ids) with the weights being trained, and
    scored by the run's reward functions (process 0 scores and broadcasts, as for rollouts).
    Greedy decoding is deterministic, so two evaluations differ only by the weights: the
    metric is comparable eval to eval, where a sampled rollout's reward also carries the draw.

    The prompts go through the sampler in chunks of data.batch_size (the rollout sampler's
    rows, which the mesh's batch axes divide), the last chunk filled with repeats of its
    first prompt, so the sampler compiles once per prompt-length bucket and is kept from one
    evaluation to the next; it is built at the first evaluation (a run with
    train.eval_every=0 builds and decodes nothing)."""

    def __init__(self, source: RolloutSource, prompts: list[Prompt], max_len: int):
        self.source, self.prompts, self.max_len = source, prompts, max_len
        self.sampler: Sampler | None = None

    def _decode(self, params: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, lengths, stopped) of the greedy completion of every prompt, on every
        process."""
        src = self.source
        if self.sampler is None:
            greedy = Sampling(temperature=0.0, n=1, stop_ids=src.stops,
                              pad_id=src.tokenizer.pad_id)
            self.sampler = Sampler(src.ctx.model_def, greedy, src.ctx.rules, src.ctx.mesh,
                                   self.max_len)
        parts = []
        for start in range(0, len(self.prompts), src.rows):
            chunk = [p.ids for p in self.prompts[start:start + src.rows]]
            out = self.sampler(params, chunk + [chunk[0]] * (src.rows - len(chunk)),
                               jax.random.key(0), src.s.max_new_tokens)  # greedy: unused
            parts.append([x[:len(chunk)] for x in _fetch((out.tokens, out.lengths,
                                                          out.stopped))])
        tokens, lengths, stopped = (np.concatenate(x) for x in zip(*parts))
        return tokens, lengths, stopped

    def metrics(self, params: Any) -> dict[str, float]:
        """`reward_mean` (the weighted sum of the reward functions, averaged over the held-out
        prompts), `reward/<function>`, `completion_length` (tokens, a stop token included) and
        `truncated_fraction` (completions that hit objective.max_new_tokens) of `params`."""
        if not self.prompts:
            raise ConfigError(paragraph(
                "This grpo run has no held-out prompt to evaluate: data.eval_fraction held out",
                "none of data.sources' records. Raise data.eval_fraction, or give held-out",
                "prompts with data.eval_sources='prompts=GLOB'."))
        tokens, lengths, stopped = self._decode(params)
        src = self.source
        completions = [src._completion(p, tokens[r, :lengths[r]])
                       for r, p in enumerate(self.prompts)]
        total, per_function = score_everywhere(
            src.rewards, [p.prompt for p in self.prompts], completions,
            [p.record for p in self.prompts])
        return {"reward_mean": float(total.mean()),
                **{f"reward/{k}": float(v.mean()) for k, v in per_function.items()},
                "completion_length": float(lengths.mean()),
                "truncated_fraction": float(1.0 - stopped.mean())}


def prepare_grpo(config: mlc.ConfigDict, workdir: str, hooks: Any = ()) -> Trainer:
    """The `grpo` run `train_grpo` runs: the loop's run (`train.loop.prepare`: resumed, with
    its hooks) with rollouts in place of the data pipeline."""
    trainer = prepare(config, workdir, hooks)
    try:
        trainer.batches = RolloutSource(trainer)
    except BaseException:
        trainer.lock.release()  # `run` would have at its end
        raise
    return trainer


def train_grpo(config: mlc.ConfigDict, workdir: str, hooks: Any = ()) -> TrainState:
    """Trains a `grpo` config in `workdir` (resuming from its newest checkpoint)."""
    return prepare_grpo(config, workdir, hooks).run()
