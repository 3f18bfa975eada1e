"""Attention: the kernels every attention module calls, its masks, and the attention components.

`kernels.py` (`attend` and the kernel table `ATTENTION_IMPLS`), `mask.py` (`Mask`: slots,
segments, causal, window), `splash.py` (the Pallas TPU kernel), `blockwise.py` (online-softmax
tiles) and `sequence/` (attention across sequence shards: allgather, ring, ring_vjp, splash
blocks). `grouped_query.py` is the decoder's grouped-query attention with its KV cache. Imports
`nn/` only, never MoE, the decoder or the adapters.
"""
