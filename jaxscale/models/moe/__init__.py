"""The mixture-of-experts feed-forward block, in place of the decoder's dense MLP.

`layer.py` (`MoEConfig`, its checks, the router, the capacity path and the router's losses),
`dropless.py` (dropless experts, expert-parallel in a shard_map), `dispatch.py` (the ragged
all-to-all dispatch) and `gmm.py` (grouped matmuls: ragged_dot, megablox, dense). Imports `nn/`
only.
"""
