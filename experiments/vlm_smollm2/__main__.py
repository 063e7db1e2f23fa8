from experiments.common import entry
from experiments.vlm_smollm2 import study

entry.quiet()  # the libraries' routine warnings off the console; --verbose keeps them
study.main()
