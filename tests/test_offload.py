"""Host offload: the optimizer state in pinned host memory (`optim.offload_state`) trains as on
the device, and its checkpoint restores into host memory.

On CPU the host and the device memory are the same RAM, so what is checked here is the
plumbing (shardings with `memory_kind='pinned_host'`, the step's copies, the checkpoint); the
HBM it saves on a TPU is measured by AOT compiles (bench/RESULTS.md).
"""

import itertools

import jax
import numpy as np

from configs.tiny_lm import get_config
from jaxscale.optim import HOST_MEMORY
from jaxscale.train.checkpoint import Checkpointer
from jaxscale.train.loop import Trainer


def _config(offload: bool):
    c = get_config("test")
    c.model.num_layers = 1
    c.mesh.update(data=2, fsdp=4)
    c.train.update(steps=4, eval_every=0)
    c.optim.offload_state = offload
    return c


def _kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _steps(trainer: Trainer, state, batches) -> tuple[object, list[float]]:
    losses = []
    for batch in batches:
        state, metrics = trainer.train_fn(state, batch)
        losses.append(float(metrics["loss"]))
    return state, losses


def test_offloaded_optimizer_state_trains_and_restores_as_on_device(tmp_path):
    """Two steps with the AdamW moments in pinned host memory equal two with them on the
    device; saved and restored, the moments come back into host memory with the same values
    and the third step from the restored state equals the third from the original."""
    host, device = Trainer.build(_config(True), None), Trainer.build(_config(False), None)
    assert _kinds(host.state.opt_state) == {HOST_MEMORY} != _kinds(device.state.opt_state)
    assert {s.memory_kind for s in jax.tree.leaves(host.shardings.opt_state)} == {HOST_MEMORY}
    batches = [host.to_global(b) for b in itertools.islice(host.batches.iterator(), 3)]
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), host.state)
    state, losses = _steps(host, host.state, batches[:2])
    _, want = _steps(device, device.state, batches[:2])
    np.testing.assert_allclose(losses, want, rtol=1e-6)
    assert _kinds(state.opt_state) == {HOST_MEMORY} and _kinds(state.params) == {"device"}

    Checkpointer(str(tmp_path), 0, 1).finish(2, state, None)
    restored, _ = Checkpointer(str(tmp_path), 0, 1).restore(template, host.shardings)
    assert _kinds(restored.opt_state) == {HOST_MEMORY}
    for got, saved in zip(jax.tree.leaves(restored.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    _, resumed = _steps(host, restored, batches[2:])
    _, straight = _steps(host, state, batches[2:])
    assert resumed == straight
