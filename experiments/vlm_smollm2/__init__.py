"""A VLM on SmolLM2-135M-Instruct (frozen, then LoRA) against LMs trained from scratch
(``python -m experiments.vlm_smollm2``, ``study.py``); the token-budget study's subset on the
frozen LM is ``experiments/token_budget/configs/smollm2_frozen.py``.
Results: ``results/vlm_smollm2/``."""
