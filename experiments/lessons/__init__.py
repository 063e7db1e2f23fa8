"""The lessons' experiments (``../shared/seeds``), one script each on scenes made in process, with
a small ViT classifier (``common.py``): ``channels`` (stems for extra input channels),
``patch_size`` (cost and accuracy per patch size and resolution, each retrained), ``patch_step`` (conv against unfold),
``pooling`` (CLS, GAP and MAP), ``positions`` (learned, sin-cos, RoPE, none) and ``registers``.
Results: ``results/lessons/<name>/``."""
