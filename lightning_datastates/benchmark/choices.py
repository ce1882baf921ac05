"""What the benchmark can compare: the checkpointing methods and the GPT sizes it trains (constants only).

Read by the parent process (the command line, the rounds) and by each worker subprocess (the model's shape, the
method's name); imports nothing, so the parent never loads torch for them.
"""

from __future__ import annotations

#: Every run seeds Lightning, the model and the synthetic tokens with it: each method trains on the same data.
SEED = 1234
#: The checkpointing methods, in the order of the report (see :mod:`lightning_datastates.benchmark.methods`).
METHODS = ("none", "torch", "async", "dcp", "datastates", "tiered")
#: The methods a run compares unless told otherwise: ``tiered`` joins them only with a slow target (``--moto``, an
#: ``s3://`` ``--dir``) or a ``--local-tier`` given. Without one its local tier and its target are directories of the
#: same disk, so its row would show a second write of every checkpoint to that disk, a set-up nobody would choose.
DEFAULT_METHODS = METHODS[:-1]
#: Methods that write local paths only, with why: skipped (with that line printed) where the target is ``s3://``.
LOCAL_ONLY = {"dcp": "torch.distributed.checkpoint's FileSystemWriter writes local paths only"}
#: GPT shapes by approximate parameter count: (vocab, dim, layers, heads, seq_len, batch_size).
MODELS: dict[str, tuple[int, int, int, int, int, int]] = {
    "3M": (4096, 256, 3, 4, 32, 2),
    "6M": (16384, 256, 2, 4, 32, 2),  # --short: few tensors, 70 MB checkpoints
    "10M": (8192, 384, 4, 6, 64, 2),
    "40M": (32768, 512, 8, 8, 64, 2),
    "125M": (50304, 768, 12, 12, 256, 4),
    "350M": (50304, 1024, 24, 16, 256, 4),
    # The shape of LLM training on one GPU: a step of ~0.1 s on an H100/H200 in bf16-mixed, 4.4 GB checkpoints.
    "368M-llm": (32000, 1024, 24, 16, 1024, 16),
    "1.3B": (50304, 2048, 24, 16, 512, 4),
    "2.7B": (50304, 2560, 32, 32, 512, 2),
    "6.7B": (50304, 4096, 32, 32, 512, 1),
}
