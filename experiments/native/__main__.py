from experiments.common import entry
from experiments.native import tokens
from vitmm import xla_flags

xla_flags.use_vitmm_defaults()  # before JAX opens a backend
entry.quiet()  # the libraries' routine warnings off the console; --verbose keeps them
tokens.main()
