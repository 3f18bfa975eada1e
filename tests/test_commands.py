"""The `jaxscale` command: every entry point by name, bundled configs found from any directory,
and an installation that adds no top-level `launch` / `configs` packages."""

import os
import re
import subprocess
import sys

import pytest

from jaxscale import configs
from jaxscale.launch import COMMANDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH_DIR = os.path.join(ROOT, "jaxscale", "launch")


def _run(args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def test_every_entry_point_is_a_command():
    modules = {f[:-3] for f in os.listdir(LAUNCH_DIR) if f.endswith(".py") and f != "__init__.py"}
    assert {module for module, _ in COMMANDS.values()} == modules
    assert {"train", "evaluate", "generate", "convert", "inspect", "plot", "lofi-local",
            "lofi-average"} <= set(COMMANDS)


def test_bundled_configs_resolve_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bundled = os.path.join(configs.DIRECTORY, "tiny_lm.py")
    for spec in ("tiny_lm", "tiny_lm.py", "configs/tiny_lm.py"):
        assert configs.resolve(spec + ":test") == bundled + ":test"
        assert configs.resolve(spec) == bundled
    own = tmp_path / "configs" / "tiny_lm.py"  # a user's own file is never shadowed
    own.parent.mkdir()
    own.write_text("")
    assert configs.resolve("configs/tiny_lm.py:test") == "configs/tiny_lm.py:test"
    assert configs.resolve("no_such_config") == "no_such_config"
    assert {"tiny_lm", "llama", "finetune_lm", "vit_digits"} <= set(configs.bundled_names())


# lm-eval's --help is the harness's own argparse text (aligned columns), not a docstring of ours.
@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "lm-eval"])
def test_help_usage_lines_read_cleanly(command, tmp_path):
    """absl prints the module docstring as the usage: a backslash line continuation there (not a
    raw string) joins two lines with a run of spaces, `... llama.py:7b         [--top=3]`."""
    out = _run(["-m", "jaxscale", command, "--help"], tmp_path)
    assert out.returncode == 0, (command, out.returncode)  # absl's own exit status is 1
    usage, sep, _ = (out.stdout + out.stderr).partition("\nflags:\n")
    assert sep and usage.strip(), (command, out.stdout[-2000:], out.stderr[-2000:])
    gaps = [line for line in usage.splitlines() if re.search(r"\S {3,}\S", line)]
    assert not gaps, (command, gaps)


def test_usage_and_unknown_command(tmp_path):
    listed = _run(["-m", "jaxscale", "help"], tmp_path)
    assert listed.returncode == 0 and all(name in listed.stdout for name in COMMANDS)
    wrong = _run(["-m", "jaxscale", "trian"], tmp_path)
    assert wrong.returncode == 2
    assert "unknown command 'trian'. Did you mean `jaxscale train`?" in wrong.stderr


@pytest.mark.slow
def test_command_runs_a_bundled_config_outside_the_checkout(tmp_path):
    out = _run(["-m", "jaxscale", "inspect", "--config=tiny_lm:test", "--compile=false",
                "--cpu_devices=8", "--config.mesh.data=2", "--config.mesh.fsdp=4"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "params per device" in out.stdout
    missing = _run(["-m", "jaxscale", "inspect", "--config=tiny_llm"], tmp_path)
    assert missing.returncode == 2
    assert "--config=tiny_llm: no such config file" in missing.stderr
    assert "tiny_lm" in missing.stderr  # the bundled names are listed


def test_installation_adds_only_jaxscale(tmp_path):
    for name in ("launch", "configs"):
        probe = _run(["-c", f"import {name}"], tmp_path)
        assert probe.returncode != 0 and "No module named" in probe.stderr, name
