"""Training on your own files: `config.data.sources` -> a deterministic weighted mixture of rows.

Each source entry (`jaxscale.data.sources`) becomes rows (`jaxscale.data.packing`). A Lo-Fi worker opens
only its shard of each source (whole files of text / jsonl / parquet, every n-th record of the
prepared formats), and the token lengths that plan the rows of on-the-fly formats are learnt by
each process tokenizing only its share of those files (`jaxscale.data.doc_index`). Per source, a grain
`MapDataset` of row indices is shuffled with the run's seed and repeated; `MapDataset.mix` interleaves the sources by weight, deterministically. Global batches
are formed from that index stream, and each process then reads only the documents of its own
rows, so the global batch at a step is identical for any process count and mesh, and grain's
iterator state (saved in checkpoints) resumes mid-epoch exactly. The held-out split is either
`data.eval_sources` or the documents whose stable hash falls below `data.eval_fraction`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import grain
import numpy as np

from jaxscale.data.chat import find_template
from jaxscale.data.chat_sources import kind_of
from jaxscale.data.doc_index import default_exchange
from jaxscale.data.packing import PACKINGS, make_rows
from jaxscale.data.sources import (
    SourceSpec,
    expand,
    hash_heldout,
    open_source,
    parse_sources,
    prepared_kind,
)
from jaxscale.data.tokenizer import BYTES, check_vocab, file_hash, load_tokenizer
from jaxscale.errors import ConfigError, paragraph
from jaxscale.storage import locations

PREFETCH = 16  # global batches read ahead per process


@dataclass(frozen=True)
class MixtureBatches:
    """Per-host batches drawn from several row sources with mixture weights."""

    rows: tuple
    weights: tuple
    global_batch: int
    process_index: int = 0
    process_count: int = 1
    seed: int = 0
    skipped_records: int = 0  # bad records skipped while indexing (data.skip_bad_records)

    def dataset(self) -> grain.MapDataset:
        if self.global_batch % self.process_count:
            raise ConfigError(paragraph(
                f"data.batch_size={self.global_batch} is not divisible by the number of",
                f"processes ({self.process_count}); every host needs the same share.",
            ))
        parts = []
        for k, src in enumerate(self.rows):
            ids = grain.MapDataset.range(src.num_rows)
            if len(ids) == 0:
                raise ConfigError(paragraph(
                    f"Source {k} of data.sources has no training row of data.seq_len tokens (in",
                    "this Lo-Fi worker's shard). Add documents, or lower data.seq_len.",
                ))
            parts.append(ids.shuffle(seed=self.seed + 1000 * k).repeat(None)
                         .map(lambda i, k=k: (k, i)))
        mixed = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, list(self.weights))
        local = self.global_batch // self.process_count
        lo = self.process_index * local
        return (mixed.batch(self.global_batch, drop_remainder=True)
                .map(lambda ki: self._gather(ki[0][lo:lo + local], ki[1][lo:lo + local])))

    def _gather(self, source_ids: np.ndarray, row_ids: np.ndarray) -> dict[str, np.ndarray]:
        rows = [self.rows[int(k)].row(int(i)) for k, i in zip(source_ids, row_ids)]
        return {key: np.stack([r[key] for r in rows]) for key in rows[0]}

    def iterator(self, state: dict | None = None) -> grain.DatasetIterator:
        """An iterator whose `get_state()` is JSON and is saved in checkpoints."""
        # A bounded read-ahead: rows of real data are large, grain's default buffer is 500.
        options = grain.ReadOptions(num_threads=4, prefetch_buffer_size=PREFETCH)
        it = iter(self.dataset().to_iter_dataset(options))
        if state is not None:
            it.set_state(state)
        return it


def heldout_mask(source: Any, fraction: float) -> np.ndarray:
    """True for the documents whose stable hash (of file name and place) is below `fraction`."""
    keys = source.reader.keys or [str(i) for i in range(source.reader.num_docs)]
    return hash_heldout([keys[i] for i in source.ids], fraction)


def check_prepared(spec: SourceSpec, tokenizer_spec: str, field_name: str) -> None:
    """A prepared dataset must be trained with the tokenizer that wrote it (file hash)."""
    if spec.format != "array_record":
        return
    for d in sorted({os.path.dirname(f) for f in expand(spec, field_name)}):
        meta_path = os.path.join(d, "metadata.json")
        if not os.path.exists(meta_path):
            continue
        with open(meta_path) as f:
            meta = json.load(f)
        want, have = meta.get("tokenizer_hash"), file_hash(tokenizer_spec)
        if want and want != have:
            raise ConfigError(paragraph(
                f"{meta_path} was prepared with tokenizer {meta.get('tokenizer')!r} (sha256",
                f"{want[:12]}...), but data.tokenizer={tokenizer_spec!r} is {have[:12]}...:",
                "the token ids would mean other words. Set --config.data.tokenizer to the",
                f"tokenizer the data was prepared with (e.g. {os.path.join(d, 'tokenizer.json')}",
                "when prepared with --train_tokenizer), or prepare the data again.",
            ))


def _sources(specs: list[SourceSpec], config: Any, tokenizer: Any, field_name: str,
             where: dict) -> list:
    d = config.data
    for spec in specs:
        check_prepared(spec, d.get("tokenizer", BYTES), field_name)
    return [open_source(s, d, tokenizer, field_name, vocab_size=config.model.vocab_size,
                        **where) for s in specs]


def make_all_rows(sources: list, d: Any, pad_id: int, also: list = ()) -> list:
    """The rows of each of `sources` with the run's packing and `seq_len`; rows carry
    `loss_mask` when these sources or `also` (the other split) hold chat, so that training and
    held-out batches have the same arrays. Preference pairs have rows of their own, so they
    are never mixed with other kinds of data."""
    kinds = {kind_of(s) for s in [*sources, *also]}
    if "preference" in kinds and len(kinds) > 1:
        raise ConfigError(paragraph(
            "data.sources / data.eval_sources mix preference pairs with",
            f"{' and '.join(sorted(kinds - {'preference'}))} data: a preference row holds a",
            "chosen and a rejected response, other rows one sequence, so they cannot share a",
            "batch. Train on the pairs alone (a preference objective), or on the others alone."))
    return [make_rows(s, d.get("packing", "concat"), d.seq_len, pad_id, "chat" in kinds,
                      d.get("train_on", "assistant")) for s in sources]


def configured_kind(d: Any) -> str:
    """What `config.data`'s sources hold, read from the config (and the `metadata.json` of
    prepared shards), no document read: `prompts` where any source holds an RL run's prompts,
    else `preference` where any source holds pairs, else
    `chat` where any holds conversations, else `text` (the stdlib demo included)."""
    kinds = set()
    for spec in parse_sources(d.get("sources", "")) if d.get("sources") else []:
        if spec.format in ("chat", "preference", "prompts"):
            kinds.add(spec.format)
        elif spec.format == "array_record":
            kinds.add(prepared_kind(expand(spec)))
    return next((k for k in ("prompts", "preference", "chat") if k in kinds), "text")


def _eval_batches(rows: list, global_batch: int, count: int, process_index: int,
                  process_count: int, required: bool = True) -> list[dict[str, np.ndarray]]:
    """The first `count` global batches of the held-out rows, in order (sources one after
    another). Fewer rows than one batch is an error when `required`, else no batch at all."""
    order = [(k, i) for k, r in enumerate(rows) for i in range(r.num_rows)]
    if len(order) < global_batch and not required:
        return []
    if len(order) < global_batch:
        raise ConfigError(paragraph(
            f"The held-out split has {len(order)} rows, fewer than one global batch of",
            f"{global_batch}. Raise data.eval_fraction, give data.eval_sources, or lower",
            "data.batch_size / data.seq_len.",
        ))
    local = global_batch // process_count
    out = []
    for b in range(min(count, len(order) // global_batch)):
        mine = order[b * global_batch + process_index * local:][:local]
        got = [rows[k].row(i) for k, i in mine]
        out.append({key: np.stack([g[key] for g in got]) for key in got[0]})
    return out


def source_eval_batches(config: Any, sources: str, process_index: int, process_count: int,
                        field_name: str = "--eval_sources") -> list[dict[str, np.ndarray]]:
    """Every row of `sources` (`FORMAT=GLOB[@WEIGHT];...`) with the run's tokenizer, packing and
    `seq_len`, as this host's rows of global batches, in order. The last batch is filled with
    rows whose `mask` is 0 (and, when packed, segment ids 0), so every real token counts once."""
    d = config.data
    tokenizer = load_tokenizer(d.get("tokenizer", BYTES))
    check_vocab(tokenizer, config.model.vocab_size, d.get("tokenizer", BYTES))
    specs = parse_sources(sources, field_name)
    if not specs:
        raise ConfigError(f"{field_name} is empty; give e.g. 'text=/data/val/*.txt'.")
    hosts = dict(process_index=process_index, process_count=process_count,
                 exchange=default_exchange(process_count))
    rows = make_all_rows(_sources(specs, config, tokenizer, field_name, hosts), d,
                         tokenizer.pad_id)
    order = [(k, i) for k, r in enumerate(rows) for i in range(r.num_rows)]
    if not order:
        raise ConfigError(paragraph(
            f"{field_name}={sources!r} gives no row of data.seq_len={d.seq_len} tokens (with",
            f"data.packing={d.get('packing', 'concat')!r}): the files are too short. Give",
            "longer or more documents.",
        ))
    global_batch, local = d.batch_size, d.batch_size // process_count
    order += [None] * (-len(order) % global_batch)
    template = rows[order[0][0]].row(order[0][1])
    out = []
    for b in range(len(order) // global_batch):
        mine = order[b * global_batch + process_index * local:][:local]
        got = [rows[m[0]].row(m[1]) if m else {k: np.zeros_like(v) for k, v in template.items()}
               for m in mine]
        batch = {key: np.stack([g[key] for g in got]) for key in template}
        batch["mask"] = np.asarray([m is not None for m in mine], np.float32)
        out.append(batch)
    return out


def files_data(config: Any, process_index: int, process_count: int,
               shard_index: int = 0, shard_count: int = 1,
               require_heldout: bool | None = None) -> tuple[MixtureBatches, list]:
    """(training batches, held-out batches) of `config.data.sources`. A held-out split too small
    for one batch is an error only where it is used: `require_heldout`, by default when the
    run evaluates (`train.eval_every` > 0); otherwise the held-out batches are []."""
    if require_heldout is None:
        require_heldout = bool(config.get("train", {}).get("eval_every", 1))
    d = config.data
    if configured_kind(d) == "prompts":  # an RL run samples its rows (jaxscale/rl/)
        from jaxscale.data.prompts import PromptBatches
        return PromptBatches(config), []
    tokenizer = load_tokenizer(d.get("tokenizer", BYTES))
    check_vocab(tokenizer, config.model.vocab_size, d.get("tokenizer", BYTES))
    specs = parse_sources(d.sources)
    if not specs:
        raise ConfigError("data.corpus='files' needs data.sources, e.g. 'jsonl=/data/*.jsonl'.")
    exchange = default_exchange(process_count)
    hosts = dict(process_index=process_index, process_count=process_count, exchange=exchange)
    train = _sources(specs, config, tokenizer, "data.sources",
                     dict(hosts, shard_index=shard_index, shard_count=shard_count))
    if d.get("eval_sources", ""):  # every Lo-Fi worker evaluates on the same documents
        heldout = _sources(parse_sources(d.eval_sources, "data.eval_sources"), config, tokenizer,
                           "data.eval_sources", hosts)
    else:
        masks = [heldout_mask(s, d.get("eval_fraction", 0.05)) for s in train]
        heldout = [s.subset(m) for s, m in zip(train, masks) if m.any()]
        train = [s.subset(~m) for s, m in zip(train, masks)]
    rows = tuple(make_all_rows(train, d, tokenizer.pad_id, heldout))
    skipped = report_skipped(d, train + heldout, process_index)
    batches = MixtureBatches(rows, tuple(s.weight for s in specs), d.batch_size, process_index,
                             process_count, seed=config.seed, skipped_records=skipped)
    eval_rows = make_all_rows(heldout, d, tokenizer.pad_id, train)
    evals = _eval_batches(eval_rows, d.batch_size, d.eval_batches, process_index, process_count,
                          require_heldout)
    return batches, evals


def files_heldout(config: Any, process_index: int, process_count: int) -> list:
    """The held-out batches of `config.data.sources` for `launch.evaluate`: required, whatever
    the run's `train.eval_every`. An RL run's prompts have none."""
    if configured_kind(config.data) == "prompts":
        raise ConfigError(paragraph(
            "This run trained on prompts=GLOB (an RL objective), which have no held-out rows to",
            "score: its rewards, and with train.eval_every its held-out prompts' greedy",
            "eval_reward_mean, are in metrics.jsonl. Evaluate the model on a benchmark with",
            "`jaxscale lm-eval --model jaxscale --model_args workdir=DIR` (docs/rl.md), or give",
            "held-out text with --eval_sources."))
    return files_data(config, process_index, process_count, require_heldout=True)[1]


def report_skipped(d: Any, sources: list, process_index: int) -> int:
    """The bad records skipped while indexing `sources` (each reader counted once), said once
    by process 0 when `data.skip_bad_records` is on, so a skip is never silent."""
    readers = {id(s.reader): s.reader for s in sources}.values()
    skipped = sum(getattr(r, "skipped", 0) for r in readers)
    if d.get("skip_bad_records", False) and process_index == 0:
        print(f"jaxscale: data.skip_bad_records: skipped {skipped} bad record"
              f"{'' if skipped == 1 else 's'} of data.sources / data.eval_sources", flush=True)
    return skipped


def validate_files(config: Any) -> None:
    """The checks that need no reading of documents, run by `config.validate` before compiling:
    sources syntax, weights, globs, packing, tokenizer file, vocabulary, prepared-data hash."""
    d = config.data
    if d.corpus not in ("stdlib", "files"):
        raise ConfigError(paragraph(
            f"data.sources is set but data.corpus={d.corpus!r}: file sources are their own",
            "dataset. Leave data.corpus at its default (or 'files'), or clear data.sources.",
        ))
    if d.packing not in PACKINGS:
        make_rows(None, d.packing, d.seq_len, 0)  # raises the one-paragraph error
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in [0, 1).")
    if d.get("train_on", "assistant") not in ("assistant", "all"):
        raise ConfigError(paragraph(
            f"data.train_on={d.train_on!r}: use 'assistant' (chat data: the loss counts the",
            "tokens the assistant produces) or 'all' (every token of the conversation)."))
    tokenizer = load_tokenizer(d.tokenizer)
    check_vocab(tokenizer, config.model.vocab_size, d.tokenizer)
    locations.configure(config.get("storage"))  # bucket globs: the run's endpoint and region
    for name in ("sources", "eval_sources"):
        for spec in parse_sources(d[name], f"data.{name}"):
            expand(spec, f"data.{name}")  # a glob matching nothing fails here
            check_prepared(spec, d.tokenizer, f"data.{name}")
            if spec.format in ("chat", "preference"):  # no template: one paragraph, now
                find_template(d.tokenizer, d.get("chat_template", ""))
    if not parse_sources(d.sources):
        raise ConfigError("data.corpus='files' needs data.sources, e.g. 'jsonl=/data/*.jsonl'.")
