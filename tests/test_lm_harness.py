"""The `jaxscale` model of EleutherAI's lm-evaluation-harness, against transformers.

A tiny random Qwen3 (transformers) with a real BPE tokenizer is the oracle: its log-probabilities
computed directly with torch, its greedy generations, and lm_eval's own `hf` model on the same
directory, on a local multiple-choice task (a YAML and a jsonl written here; no hub access).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="the lm-evaluation-harness is not installed (`eval` extra)")
torch = pytest.importorskip("torch", reason="torch (the `parity` extra) is the oracle here")
transformers = pytest.importorskip("transformers", reason="transformers is the oracle here")

from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from chat_common import tokenizer_dir
from jaxscale.inference.lm_harness import JaxscaleLM, cut_at_stops

DOCS = [("the quick brown", ["fox", "dog", "world"], 0),
        ("how are", ["you", "the", "no"], 0),
        ("two plus two", ["four", "hello", "lazy"], 0),
        ("thanks what is", ["answer", "fine", "question"], 1),
        ("yes no", ["maybe", "sure", "good"], 2),
        ("over the lazy", ["dog", "fox", "bad"], 0)]
TASK = """task: toy_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""
HUB_TASK = """task: hub_choice
dataset_path: Rowan/hellaswag
validation_split: validation
output_type: multiple_choice
doc_to_text: ctx
doc_to_choice: endings
doc_to_target: label
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    path = tokenizer_dir(str(root), "qwen2")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, pad_token_id=0)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lm(hf_dir):
    return JaxscaleLM(from_hf=hf_dir, batch_size=4, max_length=64)


def _torch_logps(hf_dir: str, ids: list[int], scored: int) -> tuple[float, bool]:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].double()
    logp = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    greedy = (logits.argmax(-1) == torch.tensor(ids[1:]))[-scored:].all()
    return float(logp[-scored:].sum()), bool(greedy)


def test_loglikelihoods_equal_a_direct_computation(lm, hf_dir):
    requests = [Instance("loglikelihood", {}, (context, " " + choice), i)
                for i, (context, choices, _) in enumerate(DOCS) for choice in choices[:2]]
    got = lm.loglikelihood(requests)
    for req, (logp, greedy) in zip(requests, got):
        context, continuation = req.args
        ctx = lm.tok_encode(context)
        whole = lm.tok_encode(context + continuation)
        want, want_greedy = _torch_logps(hf_dir, whole, len(whole) - len(ctx))
        assert logp == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy


def test_rolling_loglikelihood_sums_disjoint_windows(hf_dir):
    short = JaxscaleLM(from_hf=hf_dir, batch_size=2, max_length=8)  # forces several windows
    text = "the quick brown fox jumps over the lazy dog hello world how are you today"
    [got] = short.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = short.tok_encode(text)
    assert len(ids) > 8
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
        token_list=ids, prefix_token=short.prefix_token_id, max_seq_len=8, context_len=1)]
    assert len(windows) > 1 and sum(len(t) for _, t in windows) == len(ids)
    want = sum(_torch_logps(hf_dir, list(c) + list(t), len(t))[0] for c, t in windows)
    assert got == pytest.approx(want, abs=1e-4)


def test_generate_until_equals_transformers_greedy_cut_at_the_stop(lm, hf_dir):
    prompts = ["the quick brown", "how are you today the"]
    requests = [Instance("generate_until", {}, (p, {"until": ["zzz"], "max_gen_toks": 6}), i)
                for i, p in enumerate(prompts)]
    got = lm.generate_until(requests)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    for prompt, text in zip(prompts, got):
        ids = lm.tok_encode(prompt)
        out = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                             eos_token_id=lm.eot_token_id, pad_token_id=0)[0, len(ids):]
        new = [int(t) for t in out if int(t) != lm.eot_token_id]
        assert text == lm.tok_decode(new)
    words = got[0].split()
    if words:  # a stop string that occurs cuts the text before it
        [cut] = lm.generate_until([Instance("generate_until", {}, (
            prompts[0], {"until": [words[-1]], "max_gen_toks": 6}), 0)])
        assert cut == cut_at_stops(got[0], [words[-1]]) and words[-1] not in cut


def _local_task(root: pathlib.Path) -> pathlib.Path:
    """tasks/toy_choice.yaml and its jsonl under `root`; returns the directory."""
    tasks = root / "tasks"
    tasks.mkdir()
    data = tasks / "toy.jsonl"
    data.write_text("".join(json.dumps({"context": c, "choices": [" " + x for x in xs],
                                        "label": y}) + "\n" for c, xs, y in DOCS))
    (tasks / "toy_choice.yaml").write_text(TASK.format(data=data))
    return tasks


def test_local_tasks_alone_skip_the_index_of_the_builtin_ones(tmp_path, monkeypatch):
    import lm_eval.tasks

    from jaxscale.launch.harness import harness_flags, index_local_tasks_only

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lm_eval.tasks.TaskManager)  # undone after
    tasks = str(_local_task(tmp_path))
    local_only = lambda *argv: index_local_tasks_only(harness_flags(list(argv)))
    assert not local_only("--tasks", "toy_choice,hellaswag", "--include_path", tasks)
    assert not local_only("--tasks", "toy_choice")
    assert lm_eval.tasks.TaskManager.__name__ == "TaskManager"
    assert local_only("run", "--model", "jaxscale", "--tasks", "toy_choice", "--include_path",
                      tasks, "--batch_size", "4")
    assert lm_eval.tasks.TaskManager(include_path=tasks).all_tasks == ["toy_choice"]


def test_the_cli_matches_lm_evals_hf_model_on_a_local_task(hf_dir, tmp_path):
    import lm_eval

    tasks = _local_task(tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "jaxscale", "lm-eval", "--model", "jaxscale", "--model_args",
         f"from_hf={hf_dir},max_length=64", "--tasks", "toy_choice", "--include_path",
         str(tasks), "--output_path", str(out), "--batch_size", "4", "--log_samples"],
        capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    written = {f.split("_")[0]: os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs}
    ours = json.load(open(written["results"]))["results"]["toy_choice"]
    our_samples = [json.loads(line) for line in open(written["samples"])]

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager
    run = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={hf_dir},dtype=float32", tasks=["toy_choice"],
        task_manager=TaskManager(include_path=str(tasks), include_defaults=False), batch_size=4,
        device="cpu", log_samples=True)
    theirs = run["results"]["toy_choice"]
    for metric in ("acc,none", "acc_norm,none"):
        assert ours[metric] == theirs[metric]
    scores = lambda samples: {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]]
                              for s in samples}
    ours_by_doc, theirs_by_doc = scores(our_samples), scores(run["samples"]["toy_choice"])
    assert sorted(ours_by_doc) == list(range(len(DOCS)))
    for doc, logps in theirs_by_doc.items():
        np.testing.assert_allclose(ours_by_doc[doc], logps, atol=1e-4)

def test_bad_model_args_are_one_paragraph(hf_dir, tmp_path):
    from jaxscale.errors import ConfigError, JaxscaleError
    with pytest.raises(ConfigError, match="exactly one of"):
        JaxscaleLM()
    with pytest.raises(ConfigError, match="unknown argument"):
        JaxscaleLM(from_hf=hf_dir, pretrained="x")
    # `jaxscale lm-eval` checks these before the harness indexes its tasks: a workdir without
    # the model's shape too
    with pytest.raises(JaxscaleError, match=r"--model_args workdir=\S+empty has neither"):
        JaxscaleLM.check_arg_string(f"workdir={tmp_path}/empty,batch_size=4")



def test_a_task_whose_dataset_cannot_be_fetched_is_one_paragraph(hf_dir, tmp_path):
    # Offline (as this test machine is), a task's dataset on the hub cannot be fetched: the
    # harness's ConnectionError traceback becomes one paragraph that names the local-task way out.
    # The task is a local YAML naming hellaswag's dataset: the harness fetches it as it would
    # its own hellaswag's, without indexing its built-in tasks first.
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "hub_choice.yaml").write_text(HUB_TASK)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "jaxscale", "lm-eval", "--model", "jaxscale", "--model_args",
         f"from_hf={hf_dir},max_length=64", "--tasks", "hub_choice", "--include_path",
         str(tasks), "--limit", "2"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    error = done.stderr[done.stderr.index("jaxscale: error:"):]
    assert "hellaswag" in error and "--include_path" in error and error.count("\n") == 1


def test_the_installed_entry_point_resolves_through_the_harness_registry():
    # What plain `lm_eval --model jaxscale` does on harness releases with plugin discovery
    # (lm_eval's docs/plugins.md: the `lm_eval.models` group, each entry point registered as a
    # lazy target): here on a fresh registry, so the global one is left as the harness has it.
    import importlib.metadata

    from lm_eval.api.model import LM
    from lm_eval.api.registry import Registry

    found = importlib.metadata.entry_points(group="lm_eval.models", name="jaxscale")
    if not found:
        pytest.skip("jaxscale is not installed (a checkout on PYTHONPATH has no entry points)")
    registry = Registry("model", base_cls=LM)
    registry.register("jaxscale", target=next(iter(found)))
    assert registry.get("jaxscale") is JaxscaleLM
