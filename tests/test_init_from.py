"""`config.init_from`: the train state is built around the saved weights
(`weights.init_from.load_params`, then `train.state.init_state`): every saved parameter,
trainable or frozen (a LoRA base), is in the state as saved, the adapters are the seed's own,
and the placed arrays become the state's buffers (donated, not copied): the model is never in
memory twice at start-up, once random and once loaded."""

import jax
import numpy as np

from configs.tiny_lm import get_config
from jaxscale.mesh import make_mesh
from jaxscale.models.adapters import lora
from jaxscale.train.build import build_step
from jaxscale.train.loop import Trainer
from jaxscale.weights.init_from import export_params, load_params
from jaxscale.weights.tree import flatten


def _flat_weights(state) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for part in (state.params, state.frozen)
            for k, v in flatten(jax.device_get(part)).items()}


def _lora_config():
    c = get_config("test")
    c.lora.update(rank=4, alpha=8.0, targets=("attn/w[qv]$",))
    return c


def test_a_lora_run_takes_its_base_from_init_from_and_its_adapters_from_its_seed(tmp_path):
    source = get_config("test")
    source.seed = 7
    saved = _flat_weights(Trainer.build(source, workdir=None).state)
    export_params(str(tmp_path / "weights"), saved)

    c = _lora_config()
    fresh = _flat_weights(Trainer.build(c, workdir=None).state)  # seed 0, random base
    c.init_from = str(tmp_path / "weights")
    started = _flat_weights(Trainer.build(c, workdir=None).state)

    assert set(started) == set(fresh) and set(saved) < set(started)
    for path, value in started.items():
        want = fresh[path] if lora.is_adapter(path) else saved[path]
        np.testing.assert_array_equal(value, want, err_msg=path)
    assert any(not np.array_equal(saved[p], fresh[p]) for p in saved)  # the seeds differ


def _pointers(arrays) -> set[int]:
    return {s.data.unsafe_buffer_pointer() for a in arrays for s in a.addressable_shards}


def test_the_loaded_parameters_become_the_states_buffers(tmp_path):
    c = get_config("test")
    trainer = Trainer.build(c, workdir=None)
    export_params(str(tmp_path / "weights"), _flat_weights(trainer.state))
    setup = build_step(c, make_mesh(c.mesh))
    abstract, shardings = setup.abstract_state()
    loaded = load_params(str(tmp_path / "weights"), abstract, shardings, c.model)
    # Arrays of XLA's own: on CPU a placed leaf may wrap host memory, which no device takes over.
    loaded = {k: jax.jit(lambda a: a * 1, out_shardings=v.sharding)(v) for k, v in loaded.items()}
    buffers = _pointers(loaded.values())

    state, _ = setup.init_state(c.seed + 1, loaded)

    assert set(flatten(state.params)) == set(loaded)
    assert all(a.is_deleted() for a in loaded.values())  # donated to the state...
    assert buffers <= _pointers(jax.tree.leaves(state))  # ...whose leaves reuse every buffer
    np.testing.assert_array_equal(  # and hold the loaded values, not the seed's
        jax.device_get(flatten(state.params)["embedding"]),
        jax.device_get(flatten(trainer.state.params)["embedding"]))
