"""vitmm: vision encoders and multimodal connectors in JAX/Flax."""

__version__ = "0.1.0"
