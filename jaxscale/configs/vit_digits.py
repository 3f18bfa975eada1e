"""A small ViT trained on scikit-learn's 8x8 digits (ships with the package; no download).

`jaxscale train --config=vit_digits --workdir=DIR --cpu_devices=8` reaches
>95% test accuracy in a few CPU minutes (`jaxscale evaluate --workdir=DIR` reports it).
`:test` is a seconds-long variant for the tests. To fine-tune a Hugging Face ViT (its
directory or a `launch.convert` output), set `--config.init_from=DIR
--config.model_from_weights=true`: the run takes the weights' image size, patch size, channels
and labels.
"""

import ml_collections as mlc

from jaxscale.config import base_config
from jaxscale.errors import ConfigError

VARIANTS = ("", "test")  # "": no argument


def get_config(arg: str | None = None):
    c = base_config()
    c.model = mlc.ConfigDict(dict(
        name="vit", task="classify", image_size=8, patch_size=2, channels=1, num_classes=10,
        embed=64, num_layers=4, num_heads=4, head_dim=16, mlp=128, norm_eps=1e-6,
        remat="none",
    ))
    # seq_len counts tokens per image (16 patches + class token); it only feeds tokens/s.
    c.data.update(corpus="digits", seq_len=17, batch_size=64, eval_batches=0, max_bytes=0,
                  part="all")
    c.optim.update(lr=2e-3, warmup_steps=30, weight_decay=0.05, b2=0.99)
    c.train.update(steps=600, log_every=20, eval_every=200)
    c.checkpoint.every = 600
    if arg == "test":
        c.model.update(embed=32, num_layers=2, head_dim=8, mlp=64)
        c.data.batch_size = 32
        c.train.update(steps=60, log_every=10, eval_every=60)
        c.optim.warmup_steps = 5
        c.checkpoint.every = 0
    elif arg not in (None, ""):
        raise ConfigError(f"configs/vit_digits.py takes no argument or 'test', not {arg!r}.")
    return c
