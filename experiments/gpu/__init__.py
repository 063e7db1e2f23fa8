"""What a session lent a GPU runs: ``bench`` (the compiled step against timm + ``torch.compile``),
``loop_overhead`` (the training loop against its bare compiled step), and the shell scripts that
prepare and run a session (``session.sh``, ``carry.sh``, ``bench.sh``, ``trainer.sh``).
Results: ``results/bench_gpu/``, ``results/gpu_trainer/``."""
