"""Training workdirs on object stores (tests/servers.py): orbax checkpoints written by
tensorstore straight to SeaweedFS (s3://, custom endpoint) and fake-gcs-server (gs://), with
config.json, metrics.jsonl, the data-iterator state and TensorBoard events beside them; resume
and re-shard from there; resume after SIGKILL bit-exact; bad locations are one paragraph."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from child_env import child_env
from configs.tiny_lm import get_config
from jaxscale.observe.metrics import read_metrics
from jaxscale.storage import locations as storage
from jaxscale.storage.locations import StorageError
from jaxscale.train.checkpoint import Checkpointer
from jaxscale.train.loop import train
from jaxscale.weights.restore import saved_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _default_settings():
    storage.configure()
    yield
    storage.configure()


def _config(steps, every, **mesh):
    c = get_config("test")
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.checkpoint.every = every
    c.mesh.update(**mesh)
    return c


def _keys(server, bucket, prefix):
    out = server.client().list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in out)


def _loss(records):
    return [(m["step"], m["loss"]) for m in records]


@pytest.mark.exhaustive
@pytest.mark.slow  # several short training runs
@pytest.mark.xdist_group("seaweedfs")
def test_s3_workdir_holds_the_run_and_resumes_resharded(seaweedfs, tmp_path):
    server, bucket = seaweedfs
    workdir = f"s3://{bucket}/runs/tiny"
    train(_config(3, 3, data=8), workdir)
    keys = _keys(server, bucket, "runs/tiny/")
    assert "runs/tiny/config.json" in keys and "runs/tiny/metrics.jsonl" in keys
    assert "runs/tiny/checkpoints/3/commit_success.txt" in keys  # orbax's commit marker
    assert any(k.startswith("runs/tiny/checkpoints/3/state/ocdbt.process_0/d/") for k in keys)
    assert any(k.startswith("runs/tiny/tensorboard/events.out.tfevents") for k in keys)
    config = json.loads(storage.epath(f"{workdir}/config.json").read_text())
    assert config["checkpoint"]["every"] == 3
    data = json.loads(storage.epath(f"{workdir}/checkpoints/3/data/metadata").read_text())
    assert data, "the grain iterator state is saved with the step"
    assert saved_steps(f"{workdir}/checkpoints") == [3]
    assert not os.path.exists("s3:")  # nothing written to a local path named after the URL

    train(_config(5, 3, data=1, fsdp=4, tensor=2), workdir)  # resume on another mesh
    local = str(tmp_path / "local")  # the same history on a local disk, on one mesh
    train(_config(3, 3, data=8), local)
    assert _loss(read_metrics(workdir)[:3]) == _loss(read_metrics(local))  # bit for bit
    train(_config(5, 3, data=8), local)
    got, want = read_metrics(workdir), read_metrics(local)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=1e-5)
    assert saved_steps(f"{workdir}/checkpoints") == [5, 3]


@pytest.mark.slow  # several short training runs
@pytest.mark.xdist_group("fake-gcs")
def test_gs_workdir_on_fake_gcs_saves_and_resumes_exactly(fake_gcs, tmp_path):
    _, bucket = fake_gcs
    workdir = f"gs://{bucket}/run"
    train(_config(2, 2), workdir)
    assert saved_steps(f"{workdir}/checkpoints") == [2]
    assert storage.epath(f"{workdir}/checkpoints/2/commit_success.txt").exists()
    assert storage.epath(f"{workdir}/config.json").exists()
    train(_config(4, 2), workdir)
    train(_config(2, 2), str(tmp_path / "local"))  # the same history on a local disk
    train(_config(4, 2), str(tmp_path / "local"))
    assert _loss(read_metrics(workdir)) == _loss(read_metrics(str(tmp_path / "local")))


@pytest.mark.xdist_group("seaweedfs")
def test_torn_and_broken_steps_on_s3_are_skipped_and_set_aside(seaweedfs):
    """A save killed on an object store leaves the step's objects but no commit marker: it is
    neither listed nor restored. A committed step whose data objects are gone is skipped with
    one warning and moved aside to `<step>.broken` (copied, nothing deleted) on resume."""
    from jaxscale.weights.restore import BrokenCheckpointWarning

    server, bucket = seaweedfs
    workdir = f"s3://{bucket}/run"
    train(_config(2, 1), workdir)
    storage.epath(f"{workdir}/checkpoints/4/state/_METADATA").write_text("{}")  # torn save
    assert saved_steps(f"{workdir}/checkpoints") == [2, 1]
    assert Checkpointer(workdir, 1, 3).latest_step() == 2
    data = [k for k in _keys(server, bucket, "run/checkpoints/2/state/") if "/d/" in k]
    assert data
    for key in data:  # step 2 loses its array data but keeps its commit marker
        server.client().delete_object(Bucket=bucket, Key=key)
    with pytest.warns(BrokenCheckpointWarning, match=r"step 2 .*moved aside to 2\.broken"):
        train(_config(3, 1), workdir)
    assert saved_steps(f"{workdir}/checkpoints") == [3, 2, 1]
    assert "run/checkpoints/2.broken/commit_success.txt" in _keys(server, bucket, "run/")
    assert [m["step"] for m in read_metrics(workdir)] == [1, 2, 3]


ENV = child_env()


def _cli(workdir, steps=14, env=None, timeout=600, **kwargs):
    args = [sys.executable, "-m", "launch.train", "--config=configs/tiny_lm.py:test",
            "--cpu_devices=8", f"--config.train.steps={steps}", "--config.train.log_every=1",
            "--config.train.eval_every=0", "--config.checkpoint.every=3",
            f"--workdir={workdir}"]
    return args, {**ENV, **(env or {})}


@pytest.mark.exhaustive
@pytest.mark.slow
@pytest.mark.xdist_group("seaweedfs")
def test_sigkill_then_resume_from_s3_matches_uninterrupted(seaweedfs, tmp_path):
    server, bucket = seaweedfs
    env = server.env()
    args, full_env = _cli(tmp_path / "full", env=env)
    full = subprocess.run(args, env=full_env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert full.returncode == 0, full.stderr[-2000:]
    workdir = f"s3://{bucket}/killed"
    args, env = _cli(workdir, env=env)
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and len(read_metrics(workdir)) < 8:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(read_metrics(workdir)) < 14  # really interrupted
    resumed = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resumed from {workdir}/checkpoints/" in resumed.stdout
    got, want = read_metrics(workdir), read_metrics(str(tmp_path / "full"))
    assert [m["step"] for m in got] == list(range(1, 15))
    assert [m["loss"] for m in got] == [m["loss"] for m in want]


@pytest.mark.exhaustive
@pytest.mark.slow
@pytest.mark.xdist_group("seaweedfs")
def test_two_processes_checkpoint_to_s3_like_one_process(seaweedfs, tmp_path):
    """A 2-process run (jax.distributed, 4 CPU devices each, state sharded over both by fsdp)
    writes one orbax checkpoint to the bucket, each process its own shards, and trains as one
    process does. (Resuming from a bucket, and a 2-process resume, are tested above and in
    test_preemption.py.)"""
    server, bucket = seaweedfs
    workdir = f"s3://{bucket}/multihost"
    flags = ["--config=configs/tiny_lm.py:test", "--config.train.log_every=1",
             "--config.train.eval_every=0", "--config.checkpoint.every=3",
             "--config.train.steps=3", "--config.mesh.data=1", "--config.mesh.fsdp=8"]
    env = {**ENV, **server.env()}
    run = lambda args: subprocess.run(args, env=env, cwd=ROOT, capture_output=True,
                                      text=True, timeout=900)
    multi = run([sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
                 "--devices_per_process=4", "--", *flags, f"--workdir={workdir}"])
    assert multi.returncode == 0, (multi.stdout + multi.stderr)[-3000:]
    keys = _keys(server, bucket, "multihost/")
    assert "multihost/checkpoints/3/commit_success.txt" in keys
    for process in (0, 1):  # both processes wrote their own shards of the one checkpoint
        assert any(f"checkpoints/3/state/ocdbt.process_{process}/" in k for k in keys), keys
    assert "multihost/metrics.jsonl" in keys and "multihost/config.json" in keys
    local = run([sys.executable, "-m", "launch.train", *flags, "--cpu_devices=8",
                 f"--workdir={tmp_path / 'local'}"])
    assert local.returncode == 0, local.stderr[-3000:]
    got, want = read_metrics(workdir), read_metrics(str(tmp_path / "local"))
    assert [m["step"] for m in got] == [1, 2, 3]
    np.testing.assert_allclose([m["loss"] for m in got], [m["loss"] for m in want], rtol=1e-5)


@pytest.mark.xdist_group("seaweedfs")
def test_missing_bucket_and_refused_key_are_one_paragraph_at_start(seaweedfs, monkeypatch):
    _, bucket = seaweedfs
    with pytest.raises(StorageError, match=r"bucket 'no-such-bucket-x' does not exist") as e:
        train(_config(1, 1), "s3://no-such-bucket-x/run")
    assert "\n" not in str(e.value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with pytest.raises(StorageError, match=r"refused the credentials.*AWS_SECRET_ACCESS_KEY"):
        train(_config(1, 1), f"s3://{bucket}/run")


def test_cli_unreachable_endpoint_is_one_paragraph_within_the_timeout():
    dead = f"http://127.0.0.1:{_closed_port()}"
    args, env = _cli("s3://bucket/run", steps=1, env={"AWS_ENDPOINT_URL_S3": dead})
    out = subprocess.run(args + ["--config.storage.timeout_s=2"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert f"cannot connect to the endpoint {dead} within 2 s" in out.stderr


def _closed_port():
    from tests.servers import free_port
    return free_port()


def _convert_init_from_export(out, run, tmp_path):
    """HF dir -> launch.convert --out=`out` -> train with init_from=`out` (which supplies the
    model), workdir `run` -> launch.convert --from_workdir=`run` -> a local HF dir: the weights
    survive every hop."""
    from jaxscale.interop import convert, hf
    from jaxscale.train import loop
    from jaxscale.weights.tree import flatten
    from tests.test_hf_llama import make_hf

    _, path = make_hf(tmp_path, "gqa_untied", vocab_size=256)
    model_cfg = convert.hf_to_workdir(path, out)
    assert json.loads(storage.epath(f"{out}/model_config.json").read_text()) == model_cfg
    _, expected = hf.load_llama(path)
    config = _config(2, 2)
    config.model_from_weights = True  # the model comes with the weights in the bucket
    config.init_from = out
    trainer = loop.Trainer.build(config, run)
    for k, v in flatten(expected).items():  # training starts from exactly the HF weights
        np.testing.assert_array_equal(np.asarray(flatten(trainer.state.params)[k]), v)
    state = loop.train(config, run)
    exported = convert.workdir_to_hf(run, str(tmp_path / "export"))
    _, back = hf.load_llama(exported)
    trained = flatten(state.params)
    for k, v in flatten(back).items():
        np.testing.assert_array_equal(v, np.asarray(trained[k]))


@pytest.mark.slow  # several short training runs
@pytest.mark.xdist_group("seaweedfs")
def test_convert_and_init_from_through_s3(seaweedfs, tmp_path):
    _, bucket = seaweedfs
    _convert_init_from_export(f"s3://{bucket}/converted", f"s3://{bucket}/run", tmp_path)


@pytest.mark.xdist_group("fake-gcs")
def test_convert_out_to_gs_is_read_back_by_init_from(fake_gcs, tmp_path):
    """The gs:// data path of convert --out and init_from's reader (the training side of
    gs:// is covered by the workdir test above)."""
    from jaxscale.interop import convert, hf
    from jaxscale.weights.init_from import check_model_config
    from jaxscale.weights.sources import open_weights
    from jaxscale.weights.tree import flatten
    from tests.test_hf_llama import make_hf

    _, bucket = fake_gcs
    _, path = make_hf(tmp_path, "gqa_untied", vocab_size=256)
    out = f"gs://{bucket}/converted"
    model_cfg = convert.hf_to_workdir(path, out)
    config = _config(1, 1)
    config.model.update(model_cfg)
    check_model_config(out, config.model)  # reads gs://.../model_config.json
    weights = open_weights(out)
    assert weights.kind == "params" and weights.model_cfg == model_cfg
    _, expected = hf.load_llama(path)
    got = weights.arrays()
    for k, v in flatten(expected).items():
        np.testing.assert_array_equal(got[k], v)


def test_hf_directories_must_be_local():
    from jaxscale.interop import convert, hf

    with pytest.raises(hf.ConversionError, match=r"--to_hf=gs://b/hf is a bucket URL") as e:
        convert.local_only("gs://b/hf", "--to_hf")
    assert "\n" not in str(e.value)
    with pytest.raises(StorageError, match="does not support"):
        convert.local_only("hdfs://x/y", "--from_hf")
