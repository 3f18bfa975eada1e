"""Attention across sequence shards (`mesh.context` > 1): `context.py` picks and runs the variant
(`allgather`, `ring`, `ring_vjp`: `ring_vjp.py`; splash blocks: `context_splash.py`) when the
rules put `length` on `context`.
"""
