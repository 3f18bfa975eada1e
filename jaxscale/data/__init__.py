"""The input pipeline: dataset registry, batching, sources and readers, document index, packing, tokenizers, prepare, images.

Import the submodules directly."""
