"""Flags in any order: an override given before `--config=FILE` applies to that file's config,
for every launcher that takes a config file (issue 21, item 6)."""

import json
import os
import subprocess
import sys

import pytest

from child_env import child_env
from jaxscale.cli import config_first

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Defines the launcher's flags exactly as `python -m launch.X` does, parses them the way its
# `app.run(main, flags_parser=cli.parse_flags)` does, and prints the resolved config.
RESOLVE = ("import importlib, os, sys; from jaxscale import cli; "
           "launcher = importlib.import_module(os.environ['LAUNCHER']); "
           "cli.parse_flags(sys.argv); print(launcher._CONFIG.value.to_json(sort_keys=True))")


def _resolved(module: str, args: list[str]) -> dict:
    env = child_env(LAUNCHER=module)
    out = subprocess.run([sys.executable, "-c", RESOLVE, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("module, other", [("launch.train", "--workdir=/tmp/unused"),
                                           ("launch.inspect", "--compile=false")])
def test_override_before_config_applies_to_that_config(module, other):
    overrides = ["--config.mesh.data=8", "--config.train.steps=7"]
    config = ["--config=configs/tiny_lm.py:test"]
    first = _resolved(module, [*config, *overrides, other])
    last = _resolved(module, [*overrides, other, *config])
    assert first == last
    assert last["mesh"]["data"] == 8 and last["train"]["steps"] == 7
    assert last["data"]["batch_size"] == 16  # the :test variant, not the default config


def test_config_first_keeps_other_orders_and_what_follows_a_double_dash():
    argv = ["prog", "--config.a=1", "--workdir=w", "--config", "f.py:x", "--config.b=2", "--",
            "--config=g.py"]
    assert config_first(argv, ["config"]) == [
        "prog", "--config", "f.py:x", "--config.a=1", "--workdir=w", "--config.b=2", "--",
        "--config=g.py"]
    assert config_first(["prog", "--config.a=1", "--config=f.py"], ["config"]) == [
        "prog", "--config=f.py", "--config.a=1"]
