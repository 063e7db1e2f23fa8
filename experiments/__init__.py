"""The studies, one package each, run from the repository's root as ``python -m experiments.<study>``
(``experiments/README.md`` lists them). What they share with any study of yours, cells × seeds
that resume, statistics, tables and worker processes, is in the library (``vitmm.study``); what
only the scenes-QA studies share is in ``experiments/common``."""
