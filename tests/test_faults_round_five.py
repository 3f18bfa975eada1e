"""A fault-injection pass over issue 44's and this round's new surfaces (the rest runs in
`make chaos`'s bad-input table, bench/chaos_bad_input.py): what needs a trained workdir, a
tokenizer directory or two processes. Each fault is one paragraph, no traceback, nothing lost."""

import os
import subprocess
import sys

import pytest

from child_env import child_env
from jaxscale.errors import JaxscaleError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = child_env(JAX_PLATFORMS="cpu")


def _jaxscale(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxscale", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


def _one_paragraph(run: subprocess.CompletedProcess, words: str) -> None:
    text = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in text, text[-2000:]
    [line] = [x for x in text.splitlines() if x.startswith("jaxscale: error:")]
    assert words in line, line


def test_generate_stop_ids_outside_the_vocabulary_and_top_k_past_it(tmp_path):
    """--stop_ids that no token can match are refused, and so is a --num_samples whose KV cache
    exceeds the free memory; --top_k past the vocabulary keeps every token (as transformers
    clamps it) instead of a lax.top_k traceback."""
    from configs.tiny_lm import get_config
    from jaxscale.train.loop import train

    c = get_config("test")
    c.train.update(steps=1, eval_every=0, log_every=1)
    c.checkpoint.every = 1
    workdir = str(tmp_path / "run")
    train(c, workdir)
    gen = ["generate", f"--workdir={workdir}", "--prompt_ids=1,2", "--steps=2"]
    _one_paragraph(_jaxscale(*gen, "--stop_ids=3,99999"),
                   "--stop_ids holds [99999], outside the model's vocabulary [0, 256)")
    # a KV cache of ~19 TiB: refused, where the kernel would otherwise SIGKILL the process
    _one_paragraph(_jaxscale(*gen, "--temperature=1", f"--num_samples={10**10}"),
                   "need a KV cache of")
    # flags that would be ignored: sampling settings under greedy decoding, --chat on ids
    _one_paragraph(_jaxscale(*gen, "--num_samples=3", "--top_p=0.5"),
                   "--top_p, --num_samples shape sampling, but --temperature=0 decodes greedily")
    _one_paragraph(_jaxscale(*gen, "--chat"), "--chat renders --prompt TEXT as a user turn")
    wide, whole = (_jaxscale(*gen, "--temperature=1", f"--top_k={k}") for k in (10**8, 256))
    assert wide.returncode == 0, wide.stderr[-2000:]
    assert wide.stdout == whole.stdout  # top_k >= vocab_size is top-k off


def test_a_chat_template_that_does_not_parse_is_one_paragraph(tmp_path):
    pytest.importorskip("transformers")
    from jaxscale.data.chat import ChatEncoder
    from tests.chat_common import tokenizer_dir

    bad = tmp_path / "broken.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(JaxscaleError, match=r"broken.jinja is not valid Jinja \(unexpected") as e:
        ChatEncoder(tokenizer_dir(str(tmp_path), "qwen2"), str(bad))
    assert "\n" not in str(e.value)


def test_an_event_log_that_is_not_text_reads_as_no_events(tmp_path):
    from jaxscale.observe.events import read_events

    (tmp_path / "events.jsonl").write_bytes(bytes(range(256)) * 8 + b'\n{"event": "x"}\n')
    events, bad = read_events(str(tmp_path))
    assert events == [] and bad >= 1


@pytest.mark.slow
def test_two_processes_sharing_one_local_tier_directory_are_refused(tmp_path):
    """checkpoint.local_dir without {process} for two processes on one machine: their saves
    would overwrite each other's, so both refuse at start, before any step."""
    run = subprocess.run(
        [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
         "--devices_per_process=4", "--", "--config=configs/tiny_lm.py:test",
         "--config.train.steps=2", "--config.checkpoint.local_every=1",
         f"--config.checkpoint.local_dir={tmp_path / 'tier'}", f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in text, text[-3000:]
    for p in (0, 1):
        assert f"[p{p}] jaxscale: error: checkpoint.local_dir: processes of this run share" \
               in text, text[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
    assert os.listdir(tmp_path / "tier") == []  # markers removed, nothing saved


@pytest.mark.slow
def test_another_runs_tier_on_one_process_refuses_on_every_process(tmp_path):
    """Process 1's local tier names another run's workdir, process 0's is new: both refuse
    (agreed, not process 1 alone with process 0 waiting), and neither tier keeps anything of
    this run."""
    from jaxscale.train.local_dir import OWNER_FILE

    (tmp_path / "tier-1").mkdir()
    (tmp_path / "tier-1" / OWNER_FILE).write_text('{"workdir": "/elsewhere/run"}')
    run = subprocess.run(
        [sys.executable, "-m", "launch.local_multihost", "--num_processes=2",
         "--devices_per_process=4", "--", "--config=configs/tiny_lm.py:test",
         "--config.train.steps=2", "--config.checkpoint.local_every=1",
         f"--config.checkpoint.local_dir={tmp_path / 'tier-{process}'}",
         f"--workdir={tmp_path / 'run'}"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "Traceback" not in text, text[-3000:]
    for p in (0, 1):
        assert (f"[p{p}] jaxscale: error: checkpoint.local_dir holds another run's local tier, "
                f"on process 1 ({tmp_path / 'tier-1'} belongs to /elsewhere/run)") in text, \
            text[-3000:]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
    assert os.listdir(tmp_path / "tier-1") == [OWNER_FILE]
    assert os.listdir(tmp_path / "tier-0") == []  # the checks come first: no record written


def test_an_event_without_the_fields_the_report_reads_is_skipped(tmp_path):
    """An `exit` without its step (a hand edit, another tool's file): skipped and counted like
    a line cut short, not a KeyError."""
    from jaxscale.observe.goodput import goodput

    (tmp_path / "events.jsonl").write_text(
        '{"event": "start", "time": 1.0}\n{"event": "exit", "time": 5.0, "reason": "end"}\n'
        '{"event": "progress", "time": 2.0, "step": 3}\n')
    report = goodput(str(tmp_path))
    assert report.unreadable_lines == 2 and not report.finished
