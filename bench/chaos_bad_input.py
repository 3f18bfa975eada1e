"""The bad-input table of `make chaos`: a few bad inputs for every subcommand (a bad flag value,
a missing path, a corrupt file, an unknown config field, a config file with a syntax error),
each of which must give exit 2 and one `jaxscale: error:` paragraph, quickly. Its own module so
that tests/test_chaos.py can list and run slices of it."""

from __future__ import annotations

import os
import random
import time

from bench.chaos_harness import COMMAND_TIMEOUT_S, ERROR, JAXSCALE, check, one_paragraph, run


def bad_input_files(tmp: str) -> dict[str, str]:
    """Paths the bad-input table names: missing, corrupt and syntax-error files."""
    d = os.path.join(tmp, "bad")
    os.makedirs(os.path.join(d, "workdir"), exist_ok=True)
    files = {"missing": os.path.join(d, "no-such-thing"), "workdir": os.path.join(d, "workdir"),
             "cfg": os.path.join(d, "broken_cfg.py"), "junk": os.path.join(d, "junk.xplane.pb"),
             "tok": os.path.join(d, "tokenizer.json"), "docs": os.path.join(d, "docs.txt"),
             "out": os.path.join(d, "out"), "empty": os.path.join(d, "empty-store")}
    os.makedirs(files["empty"], exist_ok=True)
    files["nodocs"] = os.path.join(d, "no-records.jsonl")  # an empty source file
    open(files["nodocs"], "w").close()
    files["evdir"] = os.path.join(d, "events-dir")  # a workdir whose event log is a directory
    os.makedirs(os.path.join(files["evdir"], "events.jsonl"), exist_ok=True)
    files["mdir"] = os.path.join(d, "metrics-dir")  # a workdir whose metrics.jsonl is a directory
    os.makedirs(os.path.join(files["mdir"], "metrics.jsonl"), exist_ok=True)
    files["mbin"] = os.path.join(d, "metrics-binary")  # metrics.jsonl of random bytes
    os.makedirs(files["mbin"], exist_ok=True)
    with open(os.path.join(files["mbin"], "metrics.jsonl"), "wb") as f:
        f.write(b"\xde\xad" + bytes(random.Random(1).randrange(256) for _ in range(500)))

    with open(files["cfg"], "w") as f:
        f.write("def get_config(arg=None:\n    return None\n")
    for name in ("junk", "tok"):
        with open(files[name], "wb") as f:
            f.write(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    with open(os.path.join(files["workdir"], "config.json"), "w") as f:
        f.write("{not json")
    with open(os.path.join(files["workdir"], "metrics.jsonl"), "w") as f:
        f.write("garbage\n{\n")
    with open(os.path.join(files["workdir"], "events.jsonl"), "w") as f:
        f.write('garbage\n{"event": "start", "time": "noon"}\n{"event": 1, "time": 0}\n')
    with open(files["docs"], "w") as f:
        f.write("the quick brown fox\n" * 50)
    files["chattok"], files["same"] = _chat_tokenizer(d), os.path.join(d, "same-pairs.jsonl")
    with open(files["same"], "w") as f:  # preference pairs, every one chosen == rejected
        f.writelines(f'{{"prompt": "{w}", "chosen": "fox", "rejected": "fox"}}\n'
                     for w in ("the", "quick", "brown"))
    return files


def _chat_tokenizer(d: str) -> str:
    """A tokenizer directory with a chat template (a BPE of about 270 ids, trained here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    path = os.path.join(d, "chat-tokenizer")
    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}")
    return path


def bad_inputs(f: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    """(subcommand, what is wrong, flags): a few per subcommand."""
    tiny = "--config=tiny_lm:test"
    return [
        ("train", "bad flag value", [tiny, f"--workdir={f['out']}/t", "--config.train.steps=x"]),
        ("train", "unknown config field", [tiny, f"--workdir={f['out']}/t", "--config.nope=1"]),
        ("train", "config file with a syntax error", [f"--config={f['cfg']}",
                                                      f"--workdir={f['out']}/t"]),
        ("train", "checkpoint.local_dir a regular file", [
            tiny, f"--workdir={f['out']}/t2", f"--config.checkpoint.local_dir={f['docs']}",
            "--config.checkpoint.local_every=1"]),
        ("train", "checkpoint.local_dir with a brace field other than {process}", [
            tiny, f"--workdir={f['out']}/t3", "--config.checkpoint.local_every=1",
            f"--config.checkpoint.local_dir={f['out']}/tier-{{proc}}"]),
        ("train", "checkpoint.local_dir the workdir's checkpoints", [
            tiny, f"--workdir={f['out']}/t4", "--config.checkpoint.local_every=1",
            f"--config.checkpoint.local_dir={f['out']}/t4/checkpoints"]),
        ("train", "preference pairs whose chosen is always the rejected", [
            tiny, f"--workdir={f['out']}/t5", f"--config.data.sources=preference={f['same']}",
            f"--config.data.tokenizer={f['chattok']}", "--config.model.vocab_size=384",
            "--config.objective.name=dpo"]),
        ("train", "--config.lofi.store a training workdir", [
            tiny, f"--workdir={f['out']}/t6", "--config.lofi.enabled=True",
            f"--config.lofi.store={f['workdir']}"]),

        ("evaluate", "missing workdir", [f"--workdir={f['missing']}"]),
        ("evaluate", "corrupt config.json", [f"--workdir={f['workdir']}"]),
        ("evaluate", "bad flag value", [f"--workdir={f['workdir']}", "--max_batches=x"]),
        ("evaluate", "negative --max_batches", [f"--workdir={f['workdir']}", "--max_batches=-1"]),
        ("generate", "missing workdir", [f"--workdir={f['missing']}", "--prompt=hi"]),
        ("generate", "corrupt config.json", [f"--workdir={f['workdir']}", "--prompt=hi"]),
        ("generate", "bad flag value", [f"--workdir={f['workdir']}", "--steps=x"]),
        ("convert", "missing HF directory", [f"--from_hf={f['missing']}", f"--out={f['out']}/c"]),
        ("convert", "corrupt workdir", [f"--from_workdir={f['workdir']}", f"--to_hf={f['out']}/h"]),
        ("convert", "corrupt HF config.json", [f"--from_hf={f['workdir']}",
                                               f"--out={f['out']}/c"]),
        ("inspect", "missing config file", [f"--config={f['missing']}.py"]),
        ("inspect", "unknown config field", [tiny, "--config.model.nope=1"]),
        ("inspect", "config file with a syntax error", [f"--config={f['cfg']}"]),
        ("inspect", "a positional argument", [tiny, "--nocompile", "extra_positional"]),
        ("compile", "bad topology", [tiny, "--topology=v99:1x1"]),
        ("compile", "--decode_context without --decode_batch", [
            tiny, "--topology=v5p:2x2x1", "--decode_context=64"]),
        ("compile", "negative --decode_batch", [tiny, "--topology=v5p:2x2x1", "--decode_batch=-1"]),
        ("compile", "a decoding cache past HBM", [tiny, "--topology=v5p:2x2x1", "--decode_only",
                                                  "--decode_batch=1000000000"]),
        ("compile", "unknown config field", [tiny, "--topology=v5p:2x2x1", "--config.nope=1"]),
        ("compile", "config file with a syntax error", [f"--config={f['cfg']}",
                                                        "--topology=v5p:2x2x1"]),
        ("plan", "bad topology", [tiny, "--topology=garbage"]),
        ("plan", "bad flag value", [tiny, "--topology=v5p:2x2x1", "--workers=-3"]),
        ("plan", "config file with a syntax error", [f"--config={f['cfg']}",
                                                     "--topology=v5p:2x2x1"]),
        ("prepare-data", "missing sources", [f"--sources={f['missing']}/*.txt",
                                             f"--out={f['out']}/p1", "--tokenizer=bytes"]),
        ("prepare-data", "zero shards", [f"--sources={f['docs']}", f"--out={f['out']}/p2",
                                         "--tokenizer=bytes", "--num_shards=0"]),
        ("prepare-data", "sources without a record", [f"--sources={f['nodocs']}",
                                                      "--format=jsonl", f"--out={f['out']}/p4",
                                                      "--tokenizer=bytes"]),
        ("prepare-data", "a vocabulary no larger than the bytes", [
            f"--sources={f['docs']}", "--format=text", f"--out={f['out']}/p5",
            "--train_tokenizer=10"]),
        ("prepare-data", "corrupt tokenizer", [f"--sources={f['docs']}", f"--out={f['out']}/p3",
                                               f"--tokenizer={f['tok']}"]),
        ("lofi-local", "zero workers", [f"--store={f['out']}/l1", "--num_workers=0"]),
        ("lofi-local", "unknown sync", [f"--store={f['out']}/l2", "--sync=bogus"]),
        ("lofi-local", "store below a regular file", [f"--store={f['docs']}/store"]),
        ("lofi-local", "zero devices per worker", [f"--store={f['out']}/l3",
                                                   "--devices_per_worker=0"]),
        ("lofi-local", "--cpu_devices among the train flags", [
            f"--store={f['out']}/l4", "--", tiny, "--cpu_devices=4"]),
        ("lofi-local", "--store a training workdir", [f"--store={f['workdir']}", "--", tiny]),
        ("local-multihost", "zero processes", ["--num_processes=0", "--", tiny]),
        ("local-multihost", "zero devices per process", ["--devices_per_process=0", "--", tiny]),
        ("local-multihost", "--cpu_devices among the train flags", [
            "--", tiny, f"--workdir={f['out']}/m1", "--cpu_devices=4"]),
        ("local-multihost", "a --module that does not exist", [
            "--module=launch.nope", "--", tiny, f"--workdir={f['out']}/m2"]),
        ("lofi-average", "missing store", [f"--store={f['missing']}"]),
        ("lofi-average", "unknown aggregator", [f"--store={f['empty']}", "--aggregator=bogus"]),
        ("lofi-average", "a directory holding no Lo-Fi job", [f"--store={f['workdir']}"]),
        ("lofi-average", "negative --interval_s", [f"--store={f['empty']}", "--watch",
                                                   "--interval_s=-1"]),
        ("lofi-average", "--final a training workdir", [f"--store={f['empty']}",
                                                         f"--final={f['workdir']}"]),
        ("lofi-average", "negative budget, empty store", [f"--store={f['empty']}",
                                                          "--chunk_budget_mb=-1"]),
        ("plot", "missing workdir", [f['missing'], f"--out={f['out']}/x.png"]),
        ("plot", "corrupt metrics.jsonl", [f['workdir'], f"--out={f['out']}/y.png"]),
        ("plot", "no workdir given", [f"--out={f['out']}/z.png"]),
        ("plot", "metrics.jsonl a directory", [f['mdir'], f"--out={f['out']}/d.png"]),
        ("plot", "metrics.jsonl not text", [f['mbin'], f"--out={f['out']}/b.png"]),
        ("profile-summary", "missing workdir", [f['missing']]),
        ("profile-summary", "corrupt trace file", [f['junk']]),
        ("profile-summary", "bad flag value", [f['workdir'], "--top=x"]),
        ("profile-summary", "no workdir given", []),
        ("profile-summary", "two workdirs", [f['workdir'], f['missing']]),
        ("profile-summary", "--top negative", [f['workdir'], "--top=-3"]),
        ("profile-summary", "--top=0", [f['workdir'], "--top=0"]),
        ("goodput", "missing workdir", [f['missing']]),
        ("goodput", "events.jsonl of garbage and ill-typed events", [f['workdir']]),
        ("goodput", "bad flag value", [f['workdir'], "--json=x"]),
        ("goodput", "events.jsonl a directory", [f['evdir']]),
        ("goodput", "no workdir given", []),
        ("convert", "--to_peft beside --to_hf", [f"--from_workdir={f['workdir']}",
                                                 f"--to_hf={f['out']}/h2", f"--to_peft={f['out']}/a"]),
        ("convert", "a bad --max_shard_size", [f"--from_workdir={f['workdir']}",
                                               f"--to_hf={f['out']}/h3", "--max_shard_size=5XB"]),
        ("convert", "--max_shard_size on an import", [f"--from_hf={f['workdir']}",
                                                      f"--out={f['out']}/c2",
                                                      "--max_shard_size=1MB"]),
        ("convert", "--to_peft below a regular file", [f"--from_workdir={f['workdir']}",
                                                        f"--to_peft={f['docs']}/adapter"]),
        ("lm-eval", "unknown --model_args key", ["--model", "jaxscale", "--model_args", "foo=1",
                                                 "--tasks", "hellaswag"]),
        ("lm-eval", "--model_args batch_size not a number", [
            "--model", "jaxscale", "--model_args", f"workdir={f['workdir']},batch_size=x",
            "--tasks", "hellaswag"]),
        ("lm-eval", "a task name the harness does not know", [
            "--model", "jaxscale", "--model_args", f"workdir={f['workdir']}",
            "--tasks", "nosuchtask"]),
        ("lm-eval", "--model_args workdir missing", [
            "--model", "jaxscale", "--model_args", f"workdir={f['missing']}",
            "--tasks", "hellaswag"]),
    ]


def bad_input(subcommand: str, flags: list[str]) -> str:
    began = time.monotonic()
    status, out = run([*JAXSCALE, subcommand, *flags], timeout=COMMAND_TIMEOUT_S)
    assert status == 2, f"exit {status}, want 2: {out[-400:]}"
    said = one_paragraph(out)
    return f"{said} ({time.monotonic() - began:.0f} s)"


def scenario_bad_inputs(results, tmp: str, only: set[str] | None = None) -> None:
    invariant = f"exit 2, one `{ERROR}` paragraph, no traceback, < {COMMAND_TIMEOUT_S} s"
    for subcommand, what, flags in bad_inputs(bad_input_files(tmp)):
        if only is None or subcommand in only:
            check(results, f"bad input: {subcommand}", what, invariant,
                  lambda s=subcommand, fl=flags: bad_input(s, fl))
