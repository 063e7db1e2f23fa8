from experiments.native import tokens
from vitmm import xla_flags

xla_flags.use_vitmm_defaults()  # before JAX opens a backend
tokens.main()
