"""A config file that does not parse, or whose `get_config` raises, is one paragraph (issue 33,
item 7): the flag, the user's own frame (file, line, code) and the error; exit 2, no traceback
through absl, runpy and importlib. Every command with a `--config` file parses it the same way.
"""

import os
import subprocess
import sys

import pytest

from child_env import TEST_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SYNTAX = """from jaxscale.config import base_config


def get_config(arg=None):
    c = base_config()
    c.train.steps = = 3
    return c
"""

# The error is raised by ml_collections (a missing field), two frames below the user's code.
RAISES = """from jaxscale.configs.tiny_lm import get_config as tiny


def _scaled(c):
    return c.model.width * 2


def get_config(arg=None):
    c = tiny(arg)
    c.model.embed_dim = _scaled(c)
    return c
"""

COMMANDS = {
    "train": ["--workdir={tmp}/run"],
    "inspect": [],
    "compile": ["--topology=v5p:2x2x1"],
    "plan": ["--topology=v5p:2x2x1", "--cache_dir={tmp}/cache"],
}


def _run(tmp_path, command: str, source: str) -> tuple[str, subprocess.CompletedProcess]:
    path = tmp_path / "bad_config.py"
    path.write_text(source)
    flags = [f.format(tmp=tmp_path) for f in COMMANDS[command]]
    env = {**os.environ, "XLA_FLAGS": TEST_XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
    # From another directory: the config is found by its path, and nothing of the checkout.
    proc = subprocess.run([sys.executable, "-m", "jaxscale", command, f"--config={path}:test",
                           *flags], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    return str(path), proc


def _one_paragraph(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jaxscale: error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert not any(x in errors[0] for x in ("absl", "runpy", "importlib", "ml_collections"))
    return errors[0]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_config_file_with_a_syntax_error_is_one_paragraph(tmp_path, command):
    path, proc = _run(tmp_path, command, SYNTAX)
    error = _one_paragraph(proc)
    assert f"--config={path}: the config file failed to load with SyntaxError" in error, error
    assert f"at {path}, line 6: `c.train.steps = = 3`." in error, error


@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_get_config_that_raises_names_the_users_own_frame(tmp_path, command):
    path, proc = _run(tmp_path, command, RAISES)
    error = _one_paragraph(proc)
    assert f"--config={path}: the config file failed to load with AttributeError" in error
    assert "width" in error, error
    # The innermost frame of the user's, not ml_collections' (which raised it).
    assert f"at {path}, line 5, in _scaled: `return c.model.width * 2`." in error, error


def test_a_config_importing_the_checkouts_configs_alias_is_told_the_package_name(tmp_path):
    path, proc = _run(tmp_path, "train", "from configs.tiny_lm import get_config\n")
    error = _one_paragraph(proc)
    assert f"ModuleNotFoundError: No module named 'configs', at {path}, line 1" in error, error
    assert "`jaxscale.configs.NAME`" in error, error
