"""ViT on the 8x8 digits: the data split, the classification task, training through the loop,
and held-out evaluation agreeing with the loop's own eval loss."""

import jax
import numpy as np
import pytest

pytest.importorskip("sklearn")

from configs import vit_digits
from jaxscale import config as config_lib
from jaxscale.data import images as vision_data
from jaxscale.inference import evaluate
from jaxscale.observe.metrics import read_metrics
from jaxscale.train import loop


def test_digits_split_and_host_rows():
    (train_x, train_y), (test_x, test_y) = vision_data.load_digits()
    assert train_x.shape[1:] == (8, 8, 1) and len(train_y) + len(test_y) == 1797
    assert 0.0 <= train_x.min() and train_x.max() <= 1.0 and set(test_y) == set(range(10))
    config = vit_digits.get_config("test")
    full, evals = vision_data.digits_data(config, 0, 1)
    halves = [vision_data.digits_data(config, i, 2) for i in range(2)]
    b = next(full.iterator())
    assert b["images"].shape == (32, 8, 8, 1) and b["labels"].dtype == np.int32
    parts = [next(h[0].iterator()) for h in halves]  # two hosts hold the two halves of a batch
    np.testing.assert_array_equal(np.concatenate([p["labels"] for p in parts]), b["labels"])
    np.testing.assert_array_equal(
        np.concatenate([halves[0][1][0]["images"], halves[1][1][0]["images"]]),
        evals[0]["images"])


@pytest.mark.slow
def test_vit_trains_and_evaluates(tmp_path):
    config = vit_digits.get_config("test")
    config_lib.validate(config)
    state = loop.train(config, str(tmp_path))
    rows = read_metrics(str(tmp_path))
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    metrics = evaluate.evaluate_params(config, jax.device_get(state.params))
    assert metrics["accuracy"] > 0.6 and metrics["examples"] == 359  # chance is 0.1


def test_evaluation_counts_every_test_image():
    """359 test images in batches of 32: the last, partial batch is padded and masked, and the
    metrics equal a direct computation over all 359."""
    import optax

    from jaxscale.models import ModelDef
    from jaxscale.precision import get_policy

    config = vit_digits.get_config("test")
    _, (images, labels) = vision_data.load_digits()
    assert len(labels) == 359 and len(labels) % config.data.batch_size
    model_def = ModelDef.build(config.model, get_policy(config.precision))
    params = jax.device_get(model_def.init_params(jax.random.key(0)))
    metrics = evaluate.evaluate_params(config, params)
    logits = np.asarray(jax.jit(lambda p, x: model_def.module(p)(x))(params, images))
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    assert metrics["examples"] == 359
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(float(np.mean(logits.argmax(-1) == labels)))
