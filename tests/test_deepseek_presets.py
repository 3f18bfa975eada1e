"""The DeepSeek presets (`configs/deepseek.py`) have the published sizes and the tiny one
trains with its bias balancing; `test_configs.py` validates and shards every variant
abstractly."""

import numpy as np
import pytest

from configs import deepseek, llama
from helpers import train_steps
from jaxscale.errors import ConfigError
from jaxscale.train.state import flatten


@pytest.mark.parametrize("size, billions", [("v3", 671.0), ("v2-lite", 15.7)])
def test_full_sizes_have_the_published_parameter_counts(size, billions):
    assert round(llama.num_params(size, deepseek.SIZES) / 1e9, 1) == billions


def test_an_unknown_size_is_one_paragraph():
    with pytest.raises(ConfigError, match="cannot read the argument 'v4'.*tiny, v2-lite, v3"):
        deepseek.get_config("v4")


def test_the_tiny_preset_trains_and_balances():
    c = deepseek.get_config("tiny")
    c.train.steps = 4
    losses, state, _ = train_steps(c, 4)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    bias = np.asarray(flatten(state.frozen)["layers/mlp/balance_bias"])
    assert bias.shape == (1, 8) and np.abs(bias).max() > 0  # moved by the steps, not trained
