r"""Tokenize text files into ArrayRecord shards that training reads per host.

    jaxscale prepare-data --sources='docs/*.jsonl' --format=jsonl --train_tokenizer=4096 \
        --out=/tmp/prepared [--num_shards=4] [--workers=2]
    jaxscale prepare-data --sources=a/*.txt,b/*.txt --format=text \
        --tokenizer=/models/llama3 --out=/tmp/prepared
    jaxscale prepare-data --sources=chats/*.jsonl --format=chat --tokenizer=/models/qwen3 \
        --out=/tmp/prepared_chat

Writes DIR/data-*.array_record, DIR/metadata.json and DIR/tokenizer.json (chat and preference:
with the chat template); train with
`--config.data.sources=array_record=DIR/*.array_record --config.data.tokenizer=DIR`.
"""

import json

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error

_SOURCES = flags.DEFINE_list("sources", None, "Comma-separated file globs.", required=True)
_FORMAT = flags.DEFINE_enum("format", "jsonl", ["text", "jsonl", "parquet", "chat", "preference"],
                            "Source format (chat / preference: jsonl rendered with the "
                            "tokenizer's chat template).")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer.json, a dir holding one, .model or "
                                 "'bytes'.")
_TRAIN = flags.DEFINE_integer("train_tokenizer", 0, "Train a byte-level BPE of this vocabulary "
                              "size on the sources (saved as OUT/tokenizer.json).")
_OUT = flags.DEFINE_string("out", None, "Output directory: new, empty, or an interrupted "
                           "prepare's (files it did not write are never overwritten).",
                           required=True)
_SHARDS = flags.DEFINE_integer("num_shards", 1, "ArrayRecord shards to write (at least 1).")
_WORKERS = flags.DEFINE_integer("workers", 1, "Tokenizing processes (at least 1).")
_FIELD = flags.DEFINE_string("text_field", "text", "Text field of jsonl records / parquet rows.")
_SKIP = flags.DEFINE_bool("skip_bad_records", False, "Skip and count bad records.")
_TEMPLATE = flags.DEFINE_string("chat_template", "", "chat / preference: a Jinja chat template "
                                "file instead of the tokenizer directory's own.")


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from jaxscale.data.prepare import prepare
    meta = prepare(_SOURCES.value, _FORMAT.value, _OUT.value, _TOKENIZER.value, _SHARDS.value,
                   _WORKERS.value, _TRAIN.value, _FIELD.value, _SKIP.value, _TEMPLATE.value)
    print(json.dumps({k: meta[k] for k in ("documents", "tokens", "skipped_records",
                                          "tokenizer")}))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
