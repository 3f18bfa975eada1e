"""Running a trained model's weights forward: held-out evaluation, the rollout sampler, generation
and the lm-evaluation-harness model (`docs/architecture.md` names each module).

Above training, interop and the planner in the import layers (`tests/test_imports.py`): generation
opens Hugging Face directories through `interop`, and evaluation rebuilds a run as the loop built it.
"""
