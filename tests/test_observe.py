"""Seeing inside a run (issue 21): compile time apart from throughput, logger hooks that receive
each step's metrics, and a profiler trace that `launch.profile_summary` reads, all from one
short CPU run; plus the wandb logger with and without the package."""

import glob
import os
import subprocess
import sys
import time
import types

import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale.errors import ConfigError
from jaxscale.observe import loggers, throughput
from jaxscale.observe.metrics import read_metrics
from jaxscale.observe.profiling import ProfileError, format_summary, summarize
from jaxscale.train.hooks import StepInfo
from jaxscale.train.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILE_S, FIRST_STEP_S = 1000.0, 100.0  # what the fake clock adds while compiling / step 1


class FakeClock:
    """Real time plus an offset the test advances: compilation and the first step then "take"
    far longer than the rest of the run, whatever the machine's speed."""

    def __init__(self):
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset


class SlowFirst:
    """Wraps the jitted train step: compiling it costs COMPILE_S, the first call FIRST_STEP_S."""

    def __init__(self, fn, clock: FakeClock):
        self.fn, self.clock, self.calls = fn, clock, 0

    def lower(self, *args):
        self.clock.offset += COMPILE_S
        return self.fn.lower(*args)

    def __call__(self, *args):
        self.calls += 1
        if self.calls == 1:
            self.clock.offset += FIRST_STEP_S
        return self.fn(*args)


class Recorder(loggers.Logger):
    """A custom logger: keeps what the loop hands to loggers."""

    def __init__(self):
        self.records, self.closed = [], False

    def on_metrics(self, info):
        self.records.append({"step": info.step, **info.metrics})

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("observe"))
    c = get_config("test")
    c.train.update(steps=4, log_every=1, eval_every=0)
    c.train.profile.update(start_step=2, num_steps=2)
    clock, recorder = FakeClock(), Recorder()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(throughput, "time", clock)
        trainer = Trainer.build(c, workdir)
        trainer.train_fn = SlowFirst(trainer.train_fn, clock)
        trainer.hooks.append(recorder)
        trainer.run()
    return workdir, recorder


def test_first_logged_window_excludes_compilation_and_the_first_step(run):
    workdir, _ = run
    records = read_metrics(workdir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    tokens = get_config("test").data.batch_size * get_config("test").data.seq_len
    first = records[0]
    assert first["compile_s"] >= COMPILE_S and first["first_step_s"] >= FIRST_STEP_S
    # Step 1's own window holds no steady-state step: no throughput rather than a wrong one.
    assert first["step_time_s"] is None and first["tokens_per_s"] is None
    for r in records[1:]:  # had either cost leaked in, these would be >= 100 s per step
        assert r["step_time_s"] < FIRST_STEP_S / 2, r
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"])
        assert "compile_s" not in r and "first_step_s" not in r


def test_hooks_receive_each_logged_steps_metrics(run):
    workdir, recorder = run
    assert recorder.records == read_metrics(workdir)  # what metrics.jsonl got, step by step
    assert recorder.closed
    assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))


def test_hooks_run_in_their_explicit_order():
    """Loggers first, then hooks without an order (in the order added), Lo-Fi, checkpoints
    last (they save the average a sync loaded): by `order`, never by class."""
    import ml_collections

    from jaxscale.lofi.worker import LofiWorker
    from jaxscale.train.hooks import CheckpointHook, in_order

    class Plain:
        pass

    ckpt, first, second, logger = CheckpointHook(None), Plain(), Plain(), loggers.Logger()
    worker = LofiWorker(ml_collections.ConfigDict({"sync": "end"}), 1, 1)
    assert in_order([ckpt, first, worker, logger, second]) == [logger, first, second, worker,
                                                               ckpt]


def test_profile_trace_is_written_and_summarized(run):
    workdir, _ = run
    run_dirs = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*"))
    assert len(run_dirs) == 1
    assert glob.glob(os.path.join(run_dirs[0], "*.xplane.pb"))
    assert os.path.exists(os.path.join(run_dirs[0], "perfetto_trace.json.gz"))
    summary = summarize(workdir)
    # Eight-way data parallelism all-reduces the gradients: collectives take some, not all.
    assert 0.0 < summary.collective_share < 1.0
    assert any(op.collective and op.name.startswith("all-reduce") for op in summary.ops)
    assert [op.total_ns for op in summary.ops] == sorted((op.total_ns for op in summary.ops),
                                                        reverse=True)
    env = child_env(JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "launch.profile_summary", workdir, "--top=5"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == format_summary(summary, 5) + "\n"
    assert "collectives:" in out.stdout and summary.ops[0].name in out.stdout


def test_summary_of_a_workdir_without_a_trace_says_how_to_get_one(tmp_path):
    with pytest.raises(ProfileError, match="--config.train.profile.num_steps=N"):
        summarize(str(tmp_path))


def test_wandb_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)
    c = get_config("test")
    c.train.loggers = ("jsonl", "wandb")
    from jaxscale import config as config_lib
    with pytest.raises(ConfigError) as e:
        config_lib.validate(c)
    assert "pip install 'jaxscale[wandb]'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="'wandbb', which is not a logger"):
        loggers.check_names(["wandbb"])


def test_wandb_logs_config_and_metrics_when_installed(monkeypatch, tmp_path):
    calls = []
    run = types.SimpleNamespace(log=lambda data, step: calls.append(("log", data, step)),
                                finish=lambda: calls.append(("finish",)))
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or run
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: object())
    c = get_config("test")
    trainer = types.SimpleNamespace(is_primary=True, workdir=str(tmp_path), config=c)
    logger = loggers.WandbLogger(trainer, 0)
    logger.on_metrics(StepInfo(1, None, {"loss": 2.5, "tokens_per_s": None}))
    logger.at_end(StepInfo(1, None))
    (_, init), log, finish = calls
    assert init["config"] == c.to_dict() and init["resume"] == "allow"
    assert log == ("log", {"loss": 2.5}, 1) and finish == ("finish",)
    again = loggers.WandbLogger(trainer, 0)  # same workdir: the same W&B run is resumed
    assert calls[-1][1]["id"] == init["id"] and again.run is run
