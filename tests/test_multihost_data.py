"""File data across real processes (jax.distributed, gloo CPU collectives): 2 processes x 4
devices train on jsonl files with a tokenizer trained by `launch.prepare_data` exactly like one
process with 8 devices, and each process tokenizes only its own files to index them."""

import json
import os
import random
import subprocess
import sys

import pytest

from child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the quick brown fox jumps over lazy dog data model token train jax grain".split()
MULTIHOST = [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
             "--devices_per_process=4"]

PROBE = '''
import json
from absl import app, flags
from jaxscale.runtime import distributed
_DATA = flags.DEFINE_string("data", None, "")
distributed.define_flags()

def main(argv):
    distributed.setup()
    import jax
    from jaxscale.config import base_config
    from jaxscale.data.mixture import files_data
    c = base_config()
    c.model.vocab_size = 320
    c.data.update(sources=f"jsonl={_DATA.value}/docs/*.jsonl", tokenizer=f"{_DATA.value}/prep",
                  eval_sources=f"jsonl={_DATA.value}/heldout.jsonl", seq_len=32, batch_size=16,
                  packing="pack", eval_batches=1)
    reader = files_data(c, jax.process_index(), jax.process_count())[0].rows[0].source.reader
    print("PROBE " + json.dumps({"tokenized": reader.tokenized, "docs": len(reader.locs),
                                 "lengths": reader.lengths().tolist()}))

app.run(main)
'''


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    env = child_env(**env)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Four jsonl files and a held-out one; a BPE tokenizer trained by launch.prepare_data."""
    root = tmp_path_factory.mktemp("mhdata")
    rng = random.Random(0)
    doc = lambda: json.dumps({"text": " ".join(rng.choice(WORDS)
                                               for _ in range(rng.randint(3, 60)))}) + "\n"
    (root / "docs").mkdir()
    for k in range(4):
        (root / "docs" / f"part{k}.jsonl").write_text("".join(doc() for _ in range(40)))
    (root / "heldout.jsonl").write_text("".join(doc() for _ in range(60)))
    out = _run([sys.executable, "-m", "launch.prepare_data", f"--sources={root}/docs/*.jsonl",
                "--format=jsonl", "--train_tokenizer=300", f"--out={root}/prep"])
    assert out.returncode == 0, out.stderr[-3000:]
    return root


@pytest.mark.slow
def test_two_processes_index_their_own_files_and_share_lengths(data, tmp_path):
    (tmp_path / "index_probe.py").write_text(PROBE)
    single = _run([sys.executable, str(tmp_path / "index_probe.py"), f"--data={data}"])
    assert single.returncode == 0, single.stderr[-3000:]
    alone = json.loads(single.stdout.split("PROBE ", 1)[1])
    out = _run([*MULTIHOST, "--module=index_probe", "--", f"--data={data}"],
               PYTHONPATH=f"{ROOT}{os.pathsep}{tmp_path}")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    probes = [json.loads(line.split("PROBE ", 1)[1]) for line in out.stdout.splitlines()
              if "PROBE " in line]
    assert len(probes) == 2 and alone["tokenized"] == alone["docs"] == 160
    for p in probes:  # the same table everywhere; each tokenized its two files, not four
        assert p["lengths"] == alone["lengths"]
        assert p["tokenized"] == 80


@pytest.mark.exhaustive
@pytest.mark.slow
def test_two_processes_train_on_jsonl_like_one_process(data, tmp_path):
    train = ["--config=configs/tiny_lm.py:test", "--config.train.steps=3",
             f"--config.data.sources=jsonl={data}/docs/*.jsonl",
             f"--config.data.eval_sources=jsonl={data}/heldout.jsonl",
             f"--config.data.tokenizer={data}/prep", "--config.model.vocab_size=320",
             "--config.data.packing=pack", "--config.mesh.data=2", "--config.mesh.fsdp=4"]
    single = _run([sys.executable, "-m", "launch.train", *train,
                   f"--workdir={tmp_path / 'single'}", "--cpu_devices=8"])
    assert single.returncode == 0, single.stderr[-3000:]
    multi = _run([*MULTIHOST, "--", *train, f"--workdir={tmp_path / 'multi'}"])
    assert multi.returncode == 0, (multi.stdout + multi.stderr)[-3000:]
    read = lambda w: [json.loads(x) for x in (w / "metrics.jsonl").read_text().splitlines()]
    one, two = read(tmp_path / "single"), read(tmp_path / "multi")
    assert [m["step"] for m in two] == [1, 2, 3] and "eval_loss" in two[-1]
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in a or key in b:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
