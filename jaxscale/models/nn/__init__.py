"""The decoder's building blocks, below every other sub-package of `models/`.

`layers.py` (parameters with logical axes, `project`, RMSNorm, the gated MLP), `rope.py` (rotary
embeddings), `fused.py` (fused q/k/v and gate/up weights and their exact split / join),
`scan.py` (the scanned layer stack and the remat policies by name) and `shard_sums.py` (the
vocabulary-sized weights' gradients summed across batch shards in the compute dtype). Nothing
here imports attention, MoE, the decoder or the adapters.
"""
