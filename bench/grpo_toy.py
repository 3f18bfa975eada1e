"""GRPO on a toy task with a verifiable reward: a tiny random-init model learns to answer in digits.

    python bench/grpo_toy.py [--steps=20] [--workdir=DIR]

The task: prompts "Q<i>: a number? A:" (byte-level, 64 of them); the reward, in a user file
written beside the run as a user would (`toy_reward.py`), is the share of the completion's
characters that are digits. A random-init model (2 layers, width 64, ~107k parameters) writes
random bytes, of which 10 in 256 are digits, so the mean reward starts near 0.04. GRPO
(8 prompts x 8 completions of 8 tokens per step, token-level loss, no KL) must take it above 0.9.
Prints the mean reward of every step (the curve recorded in bench/RESULTS.md), the time split
between rollouts and updates, and whether it rose from under 0.3 to over 0.9.
`tests/test_grpo.py::test_toy_task_reward_rises` runs the same `run`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REWARD = '''def digits(prompts, completions, records):
    """The share of each completion's characters that are digits (0 for an empty one)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]
'''


def toy_config(directory: str, steps: int):
    """The toy run's config; writes its prompts and reward module into `directory`."""
    from jaxscale.config import base_config

    with open(os.path.join(directory, "toy_reward.py"), "w") as f:
        f.write(REWARD)
    with open(os.path.join(directory, "prompts.jsonl"), "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": f"Q{i}: a number? A:", "id": i}) + "\n")
    c = base_config()
    c.model.update(embed=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp=128)
    c.mesh.data = -1  # every device data-parallel (one on a plain CPU run)
    c.data.update(sources=f"prompts={directory}/prompts.jsonl", seq_len=32, batch_size=64)
    c.objective.update(name="grpo", rewards="toy_reward:digits", num_generations=8,
                       max_new_tokens=8, beta=0.0, loss_norm="token")
    c.optim.update(lr=1e-2, warmup_steps=0)
    c.train.update(steps=steps, log_every=1, eval_every=0, loggers=("jsonl",))
    return c


def run(steps: int, workdir: str) -> list[dict]:
    """The metrics of every step of the toy run in `workdir` (its reward module there too)."""
    from jaxscale.rl.rollout import train_grpo

    if workdir not in sys.path:
        sys.path.insert(0, workdir)
    train_grpo(toy_config(workdir, steps), os.path.join(workdir, "run"))
    with open(os.path.join(workdir, "run", "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if "reward_mean" in m]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--workdir", default="")
    args = parser.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="grpo_toy_")
    rows = run(args.steps, os.path.abspath(workdir))
    print("step  reward_mean  zero_std  completion_length  rollout_s  update_s")
    for m in rows:
        print(f"{m['step']:4d}  {m['reward_mean']:11.3f}  {m['zero_std_fraction']:8.2f}  "
              f"{m['completion_length']:17.2f}  {m['rollout_s']:9.2f}  {m['update_s']:8.2f}")
    first, last = rows[0]["reward_mean"], rows[-1]["reward_mean"]
    rollout = sum(m["rollout_s"] for m in rows[1:])
    update = sum(m["update_s"] for m in rows[1:])
    print(f"reward {first:.3f} -> {last:.3f} ({'rose' if first < 0.3 < 0.9 < last else 'FAILED'}"
          f" from under 0.3 to over 0.9); after step 1: rollouts {rollout:.1f}s, updates "
          f"{update:.1f}s, {rows[-1]['rollout_tokens_per_s']:,.0f} sampled tokens/s")


if __name__ == "__main__":
    main()
