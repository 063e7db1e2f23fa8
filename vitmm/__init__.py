"""vitmm: vision encoders and multimodal connectors in JAX/Flax.

Importing vitmm changes nothing in the process; the XLA settings vitmm prefers are applied by
its entry points (``vitmm.xla_flags.use_vitmm_defaults``).
"""

__version__ = "0.1.0"
