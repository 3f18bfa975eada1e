"""The mixture-of-experts feed-forward block, in place of the decoder's dense MLP.

`config.py` (`MoEConfig` and the sizes derived from it), `routers.py` (the routers by
`model.moe.router`, their statistics and losses), `layer.py` (the block, its checks, the
capacity path),
`dropless.py` (dropless experts, expert-parallel in a shard_map), `dispatch.py` (the ragged
all-to-all dispatch) and `gmm.py` (grouped matmuls: ragged_dot, megablox, dense). Imports `nn/`
only.
"""
