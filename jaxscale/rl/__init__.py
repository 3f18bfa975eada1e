"""Reinforcement learning on the training mesh: reward functions and GRPO's rollouts.

Above inference (it samples with the rollout sampler) and the training loop (its rollouts take
the place of the data pipeline); the objective itself, the loss of a rollout batch, lives below
training in `jaxscale/objectives/grpo.py`.
"""
