"""LoRA checkpoints with `lora.save_adapters_only`: only adapter leaves (plus a fingerprint of the
base) are written; a resumed run rebuilds the base from its seed / init_from, checks it against
the fingerprint, restores the adapters and continues exactly as an uninterrupted run; a run
whose base differs is refused with a clear error."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs.tiny_lm import get_config
from jaxscale.models.adapters import lora
from jaxscale.train.checkpoint import Checkpointer
from jaxscale.train.loop import Trainer, prepare
from jaxscale.weights.restore import CheckpointError
from jaxscale.weights.sources import rebuild_base
from jaxscale.weights.tree import flatten


def _config(steps: int, adapters_only: bool = True):
    c = get_config("test")
    c.lora.update(rank=4, alpha=8.0, targets=("attn/w[qv]$",), save_adapters_only=adapters_only)
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.optim.warmup_steps = 0
    c.checkpoint.every = 2
    return c


def _saved_tree(workdir, step: int) -> dict:
    """The saved state's tree structure (orbax metadata: shapes and dtypes, no values)."""
    import orbax.checkpoint as ocp
    from etils import epath
    path = epath.Path(Checkpointer(str(workdir), 2, 3).directory) / str(step) / "state"
    meta = ocp.StandardCheckpointHandler().metadata(path)
    return dict(meta.tree if hasattr(meta, "tree") else meta)


def _dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_adapters_only_checkpoint_resumes_like_an_uninterrupted_run(tmp_path):
    c = _config(4)
    first = prepare(c, str(tmp_path))  # resumed from and saving to the workdir
    full = jax.device_get(first.run())                    # 4 steps, saves steps 2 and 4
    tree = _saved_tree(tmp_path, 2)
    assert "frozen" not in tree and "base_fingerprint" in tree
    saved_params = flatten(tree["params"])
    assert saved_params and all(lora.is_adapter(p) for p in saved_params)
    opt_paths = [jax.tree_util.keystr(k) for k, _ in
                 jax.tree_util.tree_flatten_with_path(tree["opt_state"])[0]]
    assert all("_lora_" in k for k in opt_paths if "'layers'" in k or "embedding" in k)
    shutil.rmtree(tmp_path / "checkpoints" / "4")         # as if killed after step 2's save
    second = prepare(c, str(tmp_path))                    # base rebuilt from the same seed
    assert int(second.state.step) == 2
    resumed = jax.device_get(second.run())
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
    for name in ("params", "frozen"):
        got, want = flatten(getattr(resumed, name)), flatten(getattr(full, name))
        assert set(got) == set(want)
        for path in want:
            np.testing.assert_allclose(got[path], want[path], rtol=1e-5, atol=1e-7, err_msg=path)


def test_full_save_when_disabled_and_mismatched_base_is_refused(tmp_path):
    c = _config(2, adapters_only=False)
    trainer = Trainer.build(c, str(tmp_path / "whole"))
    checkpointer = Checkpointer(str(tmp_path / "whole"), 2, 3)
    checkpointer.save(0, trainer.state, None, adapters_only=False)
    checkpointer.save(1, trainer.state, None, adapters_only=True)
    checkpointer.wait()
    assert "frozen" in checkpointer.saved_keys(0)
    assert "frozen" not in checkpointer.saved_keys(1)
    whole, adapters = (_dir_bytes(os.path.join(checkpointer.directory, s)) for s in "01")
    assert adapters * 3 < whole
    # The base an exporter needs is rebuilt exactly from the config (seed / init_from).
    rebuilt = rebuild_base(c)
    for path, value in flatten(jax.device_get(trainer.state.frozen)).items():
        np.testing.assert_array_equal(rebuilt[path], value, err_msg=path)
    # Restoring the adapters-only step on top of the same base works ...
    restored, _ = checkpointer.restore(trainer.state, trainer.shardings, step=1)
    assert restored.frozen is trainer.state.frozen
    # ... on top of another base (another seed) it is refused, saying why.
    c.seed = 1
    other = Trainer.build(c, str(tmp_path / "other"))
    with pytest.raises(CheckpointError, match="adapters only") as err:
        checkpointer.restore(other.state, other.shardings, step=1)
    assert "init_from" in str(err.value)
    checkpointer.close()


def test_adapters_only_workdir_exports_merged_weights(tmp_path):
    """`launch.convert --from_workdir` / evaluate read an adapters-only checkpoint: the base is
    rebuilt from config.json and checked; a changed base is refused, naming init_from."""
    from jaxscale.weights.sources import WeightsError, open_weights

    c = _config(2)
    trainer = prepare(c, str(tmp_path))  # records config.json, which the export reads
    state = jax.device_get(trainer.run())
    flat = open_weights(str(tmp_path)).arrays()
    want = {**flatten(state.frozen), **flatten(state.params)}
    assert set(flat) == set(want)
    for path, value in want.items():
        np.testing.assert_allclose(flat[path], value, rtol=1e-6, atol=1e-7, err_msg=path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "seed": saved["seed"] + 1}))
    with pytest.raises(WeightsError, match="adapters only") as err:
        open_weights(str(tmp_path))
    assert "save_adapters_only=False" in str(err.value)
