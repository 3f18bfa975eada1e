"""The default demo: a ~1M-parameter byte-level Llama on the stdlib corpus, 8 simulated devices.

`--config=configs/tiny_lm.py` (default) or `configs/tiny_lm.py:test` for a seconds-long run used
by the tests. Runs in a few minutes on 2 CPU cores and drops well below the uniform-prediction
loss ln(256) = 5.55.
"""

from jaxscale.config import base_config
from jaxscale.errors import ConfigError

VARIANTS = ("", "test")  # "": no argument


def get_config(arg: str | None = None):
    c = base_config()
    c.mesh.data = -1  # all devices data-parallel; override e.g. --config.mesh.fsdp=4
    c.train.steps = 300
    c.train.log_every = 10
    c.train.eval_every = 100
    c.checkpoint.every = 100  # `make train` leaves a model to evaluate and sample from
    if arg == "test":
        c.model.update(embed=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp=128)
        c.data.update(seq_len=32, batch_size=16, max_bytes=400_000, eval_batches=2)
        c.train.update(steps=10, log_every=1, eval_every=5)
        c.checkpoint.every = 0  # the tests and docs ask for checkpoints where they use them
    elif arg not in (None, ""):
        raise ConfigError(f"configs/tiny_lm.py takes no argument or 'test', not {arg!r}.")
    return c
