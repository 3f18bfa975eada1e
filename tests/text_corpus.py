"""A small text corpus in every on-the-fly format, shared by the data-source tests."""

import json
from pathlib import Path


def write_corpus(root: Path, parts: list[list[str]], parquet_field: str = "text",
                 row_group_size: int = 40, text_files: int = 60) -> None:
    """`part{k}.jsonl` and `part{k}.parquet` per list of documents, and the first
    `text_files` documents of the first part as `text/NNN.txt`."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    for k, part in enumerate(parts):
        (root / f"part{k}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
        pq.write_table(pa.table({parquet_field: part}), root / f"part{k}.parquet",
                       row_group_size=row_group_size)
    (root / "text").mkdir()
    for i, t in enumerate(parts[0][:text_files]):
        (root / "text" / f"{i:03d}.txt").write_text(t)
