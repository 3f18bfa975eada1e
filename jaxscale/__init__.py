"""jaxscale: logical-axis sharding, precision policies and Lo-Fi training on JAX."""

__version__ = "0.1.0"
