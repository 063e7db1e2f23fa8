"""The study harness: what a study of many cells × seeds needs besides its own models.

* ``store``: cells × seeds kept on disk as they finish (a rerun with the same settings skips
  them), the settings' signature, and pinning the frozen model every cell reads;
* ``workers``: single-core worker processes with one progress bar (small models on a CPU);
* ``stats``: 95% intervals, t-tests paired by seed, Holm's correction, a blocked two-way ANOVA,
  Wilson intervals;
* ``outputs``: CSV rows, ``mean ± CI`` table cells, setup files and figures.

It lives in the library, not in ``experiments/``, because it is what a researcher reuses for a
study of their own, in their own repository: ``pip install vitmm`` brings it, its tests run with
the library's, and it depends on nothing study-specific (no scenes, no connectors). The studies
themselves (``experiments/<study>/``) are the examples of its use.
"""
