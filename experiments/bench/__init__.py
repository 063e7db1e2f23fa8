"""Speed and parity measurements on this CPU: ``cpu_vs_torch`` (vitmm's train step against PyTorch's,
with its worker processes ``workers``), ``connectors`` (each connector's step cost), ``decode``
(KV-cache decoding against transformers), ``input`` and ``readers`` (the input pipeline and the raw
data readers), ``serve`` (the server's load test), ``token_counts`` (visual tokens per setting) and
``resample_parity`` (resized towers against their sources). Results: ``results/<name>/``."""
