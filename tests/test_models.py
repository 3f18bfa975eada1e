"""Models own themselves: explicit model and loss tables with clear errors, no import of
training from the models, and pipeline runners that satisfy the `LayerRunner` interface."""

import subprocess
import sys

import pytest

from jaxscale import models
from jaxscale.errors import ConfigError
from jaxscale.mesh import make_mesh
from jaxscale.models.runner import LayerRunner
from jaxscale.parallel.pipeline import OneFOneB, PipelineRunner, make_layer_runner


def test_tables_name_every_model_and_task():
    assert set(models.MODELS) == {"llama", "vit"} and set(models.LOSSES) == {"lm", "classify"}
    with pytest.raises(ConfigError, match="model.name='gpt9'.*'llama', 'vit'"):
        models.lookup("gpt9")
    with pytest.raises(ConfigError, match="model.task='rank'.*'classify', 'lm'"):
        models.get_loss("rank")


def test_models_import_nothing_from_training():
    code = ("import sys, jaxscale.models, jaxscale.models.lora; print([m for m in sys.modules "
            "if m.startswith(('jaxscale.train', 'jaxscale.parallel'))])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=600).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("schedule, cls, fuses", [
    ("gpipe", PipelineRunner, False), ("circular", PipelineRunner, False),
    ("1f1b", OneFOneB, True)])
def test_runners_satisfy_the_interface(schedule, cls, fuses):
    mesh = make_mesh({"pipeline": 2, "data": 4})
    runner = make_layer_runner(dict(schedule=schedule, microbatches=2,
                                    repeats=2 if schedule == "circular" else 1), mesh, "none", 4)
    assert isinstance(runner, cls) and isinstance(runner, LayerRunner)
    assert runner.microbatches == 2 and runner.fuses_loss is fuses
    assert isinstance(runner.scaled(2.0), cls)
