"""What a session lent a GPU runs: ``bench`` (the compiled step's speed and MFU; its PyTorch peer,
timm + ``torch.compile``, is not written yet: issue 52),
``loop_overhead`` (the training loop against its bare compiled step), and the shell scripts that
prepare and run a session (``session.sh``, ``carry.sh``, ``bench.sh``, ``trainer.sh``).
Results: ``results/bench_gpu/``, ``results/gpu_trainer/``."""
