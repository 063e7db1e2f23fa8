"""Native resolution: visual tokens from square resizing, NaFlex and AnyRes at equal budgets
(``python -m experiments.native``, ``tokens.py``; ``features.py`` makes each path's features),
their costs (``python -m experiments.native.costs``) and the native CLIP's evaluation
(``python -m experiments.native.eval``). Results: ``results/native/``."""
