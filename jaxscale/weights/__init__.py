"""Weights outside a running train state: tree helpers, placement onto a mesh, the committed
snapshot format (`snapshot`, on `kv`, `manifest`, `localfs` and `push_codec`: params exports,
Lo-Fi pushes and averages), `config.init_from` (`init_from`), and every saved format (params
export, training checkpoint, Lo-Fi average, Hugging Face directory) behind one
`open_weights(location)` (`sources`). Import the submodules directly."""
