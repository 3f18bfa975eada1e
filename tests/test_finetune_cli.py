"""The fine-tuning walk-through through the real entry points, each in its own process:
HF Llama -> launch.convert -> launch.train --config.init_from -> launch.evaluate ->
launch.generate -> launch.convert --to_hf -> transformers; the same for a HF ViT on the digits;
and the one-paragraph errors (exit 2, no traceback) for bad inputs."""

import json
import math
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest

from child_env import child_env

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(module: str, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    env = child_env(JAX_PLATFORMS="cpu")  # the entry points simulate devices with --cpu_devices
    run = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    if ok:
        assert run.returncode == 0, f"{module} {args}\n{run.stdout}\n{run.stderr}"
    return run


def printed_command(stdout: str) -> list[str]:
    """The `jaxscale train` command launch.convert prints, as arguments after `train`."""
    line = next(x for x in stdout.splitlines() if x.startswith("Fine-tune with:"))
    words = shlex.split(line.removeprefix("Fine-tune with:"))
    assert words[:2] == ["jaxscale", "train"], line
    return words[2:]


def make_llama(path: str):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=0)).eval()
    model.save_pretrained(path)
    return model


def greedy(model, ids: list[int], steps: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0].tolist()


@pytest.mark.exhaustive
@pytest.mark.slow
def test_llama_convert_finetune_evaluate_generate_export(tmp_path):
    from jaxscale.interop import convert, hf

    hf_dir, conv, run, export = (str(tmp_path / n) for n in ("hf", "conv", "run", "export"))
    original = make_llama(hf_dir)
    printed = printed_command(cli("launch.convert", f"--from_hf={hf_dir}", f"--out={conv}").stdout)
    assert printed[:3] == ["--config=finetune_lm:lora", "--workdir=RUN", f"--config.init_from={conv}"]
    assert not any(a.startswith("--config.model.") for a in printed)  # the model comes along

    cli("launch.train", "--config=finetune_lm:test", f"--workdir={run}",
        "--cpu_devices=8", f"--config.init_from={conv}", "--config.train.steps=3",
        "--config.train.eval_every=0", "--config.checkpoint.every=3")
    metrics = json.loads(cli("launch.evaluate", f"--workdir={run}", "--cpu_devices=8",
                             "--max_batches=1").stdout.splitlines()[-1])
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))
    assert metrics["tokens"] > 0 and 0 <= metrics["accuracy"] <= 1

    cli("launch.convert", f"--from_workdir={run}", f"--to_hf={export}",
        "--max_shard_size=40KB")
    assert os.path.exists(os.path.join(export, "model.safetensors.index.json"))
    tuned = transformers.LlamaForCausalLM.from_pretrained(export).eval()
    trained = convert.workdir_params(run)  # the checkpoint, read in this process
    tokens = torch.arange(0, 40, 2).reshape(1, 20)
    with torch.no_grad():
        got, before = tuned(tokens).logits.numpy(), original(tokens).logits.numpy()
    np.testing.assert_array_equal(hf.load_llama(export).params["lm_head"],
                                  np.asarray(trained["lm_head"]))
    assert np.max(np.abs(got - before)) > 1e-3  # fine-tuning changed the model

    prompt = [104, 101, 108, 108, 111]
    ids = ",".join(map(str, prompt))
    out = cli("launch.generate", f"--workdir={run}", f"--prompt_ids={ids}",
              "--max_new_tokens=8", "--cpu_devices=8").stdout.strip().splitlines()[-1]
    assert [int(t) for t in out.split(",")] == greedy(tuned, prompt, 8)

    sampled = [cli("launch.generate", f"--from_hf={hf_dir}", f"--prompt_ids={ids}",
                   "--steps=12", "--temperature=1.0", f"--seed={s}", "--cpu_devices=4"
                   ).stdout.strip().splitlines()[-1] for s in (3, 3, 4)]
    assert sampled[0] == sampled[1] != sampled[2]  # greedy from --from_hf: test_generate.py


@pytest.mark.exhaustive
@pytest.mark.slow
def test_vit_export_reimport_finetune_evaluate(tmp_path):
    """A digits ViT trained here goes out to transformers (same logits) and comes back as the
    pretrained start of a fine-tune that keeps its accuracy; evaluation counts all 359 images."""
    from jaxscale.data.images import load_digits
    from jaxscale.interop import convert

    pre, hf_dir, conv, run = (str(tmp_path / n) for n in ("pre", "hf", "conv", "run"))
    cli("launch.train", "--config=configs/vit_digits.py:test", f"--workdir={pre}",
        "--cpu_devices=8", "--config.checkpoint.every=60")
    cli("launch.convert", f"--from_workdir={pre}", f"--to_hf={hf_dir}")
    model = transformers.ViTForImageClassification.from_pretrained(hf_dir).eval()
    _, (images, labels) = load_digits()
    with torch.no_grad():
        ref = model(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).logits.numpy()
    model_cfg, _ = convert.read_model_config(pre)
    from jaxscale.models import ModelDef
    from jaxscale.precision import get_policy
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    ours = np.asarray(model_def.module(convert.workdir_params(pre))(images))
    assert np.max(np.abs(ours - ref)) < 1e-4

    printed = printed_command(cli("launch.convert", f"--from_hf={hf_dir}", f"--out={conv}").stdout)
    assert printed[-1] == "--config.model_from_weights=true"  # a ViT goes with the user's config
    cli("launch.train", "--config=configs/vit_digits.py:test", f"--workdir={run}",
        "--cpu_devices=8", f"--config.init_from={conv}", printed[-1], "--config.train.steps=10",
        "--config.train.eval_every=0", "--config.checkpoint.every=10",
        "--config.optim.lr=3e-4")
    metrics = json.loads(cli("launch.evaluate", f"--workdir={run}",
                             "--cpu_devices=8").stdout.splitlines()[-1])
    assert set(metrics) == {"loss", "accuracy", "examples"} and metrics["examples"] == 359
    pretrained_acc = float(np.mean(ref.argmax(-1) == labels))
    assert pretrained_acc > 0.6 and metrics["accuracy"] > pretrained_acc - 0.1, (
        pretrained_acc, metrics)


@pytest.mark.parametrize("module, args, culprit", [
    ("launch.generate", ["--from_hf=HF", "--prompt_ids=1,x"], "not a comma-separated list"),
    ("launch.generate", ["--from_hf=HF", "--prompt_ids=1,999"], r"\[999\], outside"),
    ("launch.generate", ["--from_hf=HF", "--prompt_ids=1", "--max_new_tokens=0"],
     "at least one"),
    ("launch.generate", ["--from_hf=HF", "--prompt_ids=1", "--steps=200"], "max_len=128"),
    ("launch.generate", ["--from_hf=HF", "--prompt_ids=1", "--top_p=1.5", "--num_samples=0"],
     r"top_p=1.5 .*n=0"),
    ("launch.convert", ["--from_hf=HF", "--out=OUT", "--dtype=int3"], "'int3' is not supported"),
    ("launch.convert", ["--from_hf=HF/missing", "--out=OUT"], "not a directory"),
])
def test_cli_errors_are_one_paragraph(tmp_path, module, args, culprit):
    hf_dir = str(tmp_path / "hf")
    make_llama(hf_dir)
    args = [a.replace("HF", hf_dir).replace("OUT", str(tmp_path / "out")) for a in args]
    run = cli(module, *args, ok=False)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("jaxscale: error: ")
    import re
    assert re.search(culprit, message), message


def test_generate_samples_and_stops(tmp_path):
    """`--stop_ids` ends each of `--num_samples` lines at the stop token (kept, nothing after)."""
    hf_dir = str(tmp_path / "hf")
    make_llama(hf_dir)
    last = lambda run: run.stdout.strip().splitlines()
    greedy = last(cli("launch.generate", f"--from_hf={hf_dir}", "--prompt_ids=5,6,7",
                      "--steps=6"))[-1].split(",")
    stop = greedy[5]  # the third new token
    lines = last(cli("launch.generate", f"--from_hf={hf_dir}", "--prompt_ids=5,6,7",
                     "--steps=6", "--num_samples=2", f"--stop_ids={stop}",
                     "--temperature=1", "--top_k=1"))[-2:]  # top-k 1: the greedy token
    first = greedy.index(stop, 3)
    assert lines == [",".join(greedy[:first + 1])] * 2


def _corrupt_copies(tmp_path) -> dict[str, str]:
    """A HF Llama directory and broken variants: a truncated model.safetensors, a header
    length of 2^60; a regular file where an output directory is expected."""
    import shutil
    good = str(tmp_path / "hf")
    make_llama(good)
    weights = os.path.join(good, "model.safetensors")
    paths = {"HF": good, "FILE": str(tmp_path / "a_file")}
    with open(paths["FILE"], "w") as f:
        f.write("keep me\n")
    paths["TRUNC"] = shutil.copytree(good, str(tmp_path / "trunc"))
    os.truncate(os.path.join(paths["TRUNC"], "model.safetensors"),
                os.path.getsize(weights) // 2)
    paths["HUGE"] = shutil.copytree(good, str(tmp_path / "huge"))
    with open(os.path.join(paths["HUGE"], "model.safetensors"), "r+b") as f:
        f.write((2 ** 60).to_bytes(8, "little"))
    paths["CONV"] = str(tmp_path / "conv")
    os.makedirs(paths["CONV"])
    with open(os.path.join(paths["CONV"], "model_config.json"), "w") as f:
        json.dump({"name": "llama"}, f)
    return paths


@pytest.mark.parametrize("module, args, culprit", [
    ("launch.convert", ["--from_hf=TRUNC", "--out=OUT"], "TRUNC/model.safetensors is not a"),
    ("launch.convert", ["--from_hf=HUGE", "--out=OUT"], "HUGE/model.safetensors is not a"),
    ("launch.generate", ["--from_hf=TRUNC", "--prompt_ids=1"], "TRUNC/model.safetensors is"),
    ("launch.generate", ["--from_hf=HUGE", "--prompt_ids=1"], "HUGE/model.safetensors is"),
    ("launch.convert", ["--from_workdir=CONV", "--to_hf=FILE"], "--to_hf=FILE names an"),
    ("launch.convert", ["--from_workdir=CONV", "--to_peft=OUT"], "CONV is not a LoRA run"),
    ("launch.convert", ["--from_hf=HF", "--out=FILE"], "--out=FILE names an existing file"),
    ("launch.train", ["--config=configs/tiny_lm.py:test", "--workdir=FILE"],
     "--workdir=FILE names an existing file"),
])
def test_broken_inputs_and_file_outputs_are_one_paragraph(tmp_path, module, args, culprit):
    """Issue 22 item 13: truncated / absurd safetensors and output paths naming a regular file
    exit 2 with one paragraph naming the culprit (no traceback), and the file is untouched."""
    import re
    paths = {**_corrupt_copies(tmp_path), "OUT": str(tmp_path / "out")}
    sub = lambda text: re.sub(r"\b(TRUNC|HUGE|CONV|FILE|HF|OUT)\b",
                              lambda m: paths[m.group(1)], text)
    run = cli(module, *map(sub, args), ok=False)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("jaxscale: error: ") and sub(culprit) in message, message
    with open(paths["FILE"]) as f:
        assert f.read() == "keep me\n"
