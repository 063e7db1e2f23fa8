"""vitmm's experiment configs: one file per experiment (``get_config(arg)``), small shared
builders in ``common.py``. Installed with vitmm so that ``from configs import common`` works
from any directory."""
