"""Input throughput: tokens/s one process gets from each source format with packing on,
against what a train step consumes (a measured tiny_lm tokens/s, passed in, and the 1B preset's
analytic tokens/s at 45% MFU on one TPU v5p chip).

    python bench/input_pipeline.py --docs=DIR_OF_JSONL --prepared=DIR --tokenizer=DIR \
        [--step_tokens_per_s=1476] [--batches=20]
"""

import argparse
import glob
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from configs import llama
from jaxscale.config import base_config
from jaxscale.data.mixture import files_data
from jaxscale.data.tokenizer import load_tokenizer
from jaxscale.hardware import PEAK_FLOPS
from jaxscale.observe.metrics import model_flops_per_token


def tokens_per_s(sources: str, tokenizer: str, vocab: int, packing: str, batches: int) -> float:
    c = base_config()
    c.data.update(sources=sources, tokenizer=tokenizer, seq_len=512, batch_size=16,
                  packing=packing, eval_batches=1, eval_sources=sources)  # eval unused
    c.model.vocab_size = vocab
    it = files_data(c, 0, 1)[0].iterator()
    next(it)  # plans rows (and, for on-the-fly formats, tokenizes to learn lengths)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * 16 * 512 / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", required=True)
    p.add_argument("--prepared", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--step_tokens_per_s", type=float, default=1476.0)
    p.add_argument("--batches", type=int, default=20)
    a = p.parse_args()
    tok = load_tokenizer(a.tokenizer)
    flat = os.path.join(a.prepared, "bench.tokens")
    if not os.path.exists(flat):  # the prepared records as one flat uint16 file
        import grain
        src = grain.sources.ArrayRecordDataSource(sorted(glob.glob(f"{a.prepared}/*.array_record")))
        np.concatenate([np.frombuffer(src[i], np.uint32) for i in range(len(src))]
                       ).astype(np.uint16).tofile(flat)
    m = llama.get_config("1b").model
    fpt = model_flops_per_token(m, 2048)
    v5p = 0.45 * PEAK_FLOPS["TPU v5p"] / fpt
    print(f"1B preset at 45% MFU on one v5p chip: {v5p:,.0f} tokens/s; "
          f"tiny_lm step here: {a.step_tokens_per_s:,.0f} tokens/s")
    cases = [("jsonl", f"jsonl={a.docs}/*.jsonl", "pack"),
             ("array_record", f"array_record={a.prepared}/*.array_record", "pack"),
             ("tokens", f"tokens={flat}", "concat")]
    for name, sources, packing in cases:
        rate = tokens_per_s(sources, a.tokenizer, tok.vocab_size, packing, a.batches)
        print(f"{name:13s} packing={packing:6s} {rate:12,.0f} tokens/s  "
              f"x{rate / a.step_tokens_per_s:8.1f} tiny_lm step  x{rate / v5p:6.2f} 1B on v5p")


if __name__ == "__main__":
    main()
