"""jaxscale.weights: tree helpers, the one placement function, and open_weights's formats."""

import os

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxscale.mesh import make_mesh
from jaxscale.weights.leaf import Leaf
from jaxscale.weights.place import place
from jaxscale.weights.sources import WeightsError, open_weights
from jaxscale.weights.tree import flatten, merge_trees, split_trainable, unflatten
from tests.lofi_common import _params


def test_tree_round_trip_and_trainable_split():
    tree = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    assert flatten(tree) == {"a/b": 1, "a/c/d": 2, "e": 3}
    assert unflatten(flatten(tree)) == tree
    trainable, frozen = split_trainable(tree, lambda p: p.startswith("a/c"))
    assert trainable == {"a": {"c": {"d": 2}}} and frozen == {"a": {"b": 1}, "e": 3}
    assert merge_trees(trainable, frozen) == tree


def test_place_reads_only_local_blocks_and_keeps_placed_arrays():
    mesh = make_mesh(dict(data=1, pipeline=1, fsdp=4, tensor=2))
    full = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    reads = []

    def read(index):
        reads.append(full[index].shape)
        return full[index]

    sharding = NamedSharding(mesh, PartitionSpec("fsdp", None))
    lazy = Leaf(full.shape, np.float32, read, reads_slices=True)
    placed = place({"w": lazy}, {"w": sharding}, np.float32)["w"]
    np.testing.assert_array_equal(np.asarray(placed), full)
    assert placed.sharding == sharding
    assert reads == [(2, 6)] * 4  # one read per distinct block; the tensor replicas share it
    again = place({"w": placed}, {"w": sharding}, np.float32)["w"]
    assert again is placed  # already placed with that sharding and dtype: kept as it is
    cast = place({"w": full}, {"w": sharding}, jax.numpy.bfloat16)["w"]
    assert cast.dtype == jax.numpy.bfloat16


def test_open_weights_reads_a_lofi_average(store):
    weights = open_weights(store.location)
    assert weights.kind == "lofi_average" and weights.step == 0
    for k, v in _params(0).items():
        assert weights.leaves[k].shape == v.shape
        np.testing.assert_array_equal(np.asarray(weights.leaves[k]), v)


def test_open_weights_refuses_what_holds_no_weights(tmp_path):
    with pytest.raises(WeightsError, match="holds no weights"):
        open_weights(str(tmp_path))
    (tmp_path / "file").write_text("x")
    with pytest.raises(WeightsError, match="is a file"):
        open_weights(str(tmp_path / "file"))
    assert os.listdir(tmp_path) == ["file"]  # nothing created while looking


def test_open_weights_reads_a_huggingface_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from jaxscale.interop import hf

    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)).save_pretrained(str(tmp_path))
    weights = open_weights(str(tmp_path))
    assert weights.kind == "huggingface" and weights.model_cfg["embed"] == 16
    expected = flatten(hf.load_llama(str(tmp_path)).params)
    assert set(weights.leaves) == set(expected)
    for k, v in expected.items():
        np.testing.assert_array_equal(np.asarray(weights.leaves[k]), v)
