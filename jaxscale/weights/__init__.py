"""Weights outside a running train state: tree helpers, placement onto a mesh, and every saved
format (params export, training checkpoint, Lo-Fi average, Hugging Face directory) behind one
`open_weights(location)`. Import the submodules (`tree`, `place`, `sources`) directly."""
