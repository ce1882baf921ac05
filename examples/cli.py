"""Train with LightningCLI and one of the configs in ``configs/``: checkpointing is configured in yaml alone.

    python examples/cli.py fit --config configs/local.yaml
    python examples/cli.py fit --config configs/local.yaml --trainer.max_steps=8 \\
        --trainer.plugins.init_args.host_cache=256MiB --trainer.callbacks.init_args.dirpath=/tmp/ckpt

Any setting can be overridden on the command line (``--print_config`` shows them all). Sizes take integers of
bytes or strings such as ``8GiB``.
"""

from __future__ import annotations

from gpt_data import TokenData
from lightning.pytorch.cli import LightningCLI

from lightning_datastates.demo import GPT


class SmallGPT(GPT):
    """The demo's GPT with defaults, so the CLI needs no model arguments (``--model.dim=256`` changes one)."""

    def __init__(self, vocab: int = 512, dim: int = 64, layers: int = 2, heads: int = 2, seq_len: int = 32) -> None:
        super().__init__(vocab, dim, layers, heads, seq_len)


def main() -> None:
    LightningCLI(SmallGPT, TokenData)


if __name__ == "__main__":
    main()
