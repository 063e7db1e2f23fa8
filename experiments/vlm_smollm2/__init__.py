"""A VLM on the frozen SmolLM2-135M-Instruct against LMs trained from scratch, and the token-budget
study's frozen subset on it (``python -m experiments.vlm_smollm2``, ``study.py``).
Results: ``results/vlm_smollm2/``."""
