"""Train with LightningCLI and one of the configs in ``configs/``: checkpointing is configured in yaml alone.

    python examples/cli.py fit --config configs/local.yaml --trainer.max_steps=200
    python examples/cli.py fit --config configs/local.yaml --trainer.max_steps=8 \\
        --trainer.callbacks.init_args.every_n_train_steps=4 --trainer.callbacks.init_args.dirpath=/tmp/ckpt

Any setting can be overridden on the command line (``--print_config`` shows them all). Sizes take integers of
bytes or strings such as ``8GiB``. A bad ``DataStatesIO`` setting (a misspelt name, a value of the wrong type) ends
the command with the plugin's own message as its last line (``DataStatesCLI``; plain ``LightningCLI`` works too, with
jsonargparse's longer report). ``--ckpt_path last`` resumes from the newest checkpoint (the configs set
``save_last``). A relative ``dirpath`` (``checkpoints`` in configs/local.yaml) is relative to the directory the
command runs in; after ``fit`` this script prints where the checkpoints went.
"""

from __future__ import annotations

import os

from gpt_data import TokenData
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import ArgsType, LightningCLI

from lightning_datastates.demo import GPT
from lightning_datastates.lightning_cli import DataStatesCLI


class SmallGPT(GPT):
    """The demo's GPT with defaults, so the CLI needs no model arguments (``--model.dim=256`` changes one)."""

    def __init__(self, vocab: int = 512, dim: int = 64, layers: int = 2, heads: int = 2, seq_len: int = 32) -> None:
        super().__init__(vocab, dim, layers, heads, seq_len)


def main(args: ArgsType = None) -> LightningCLI:
    cli = DataStatesCLI(SmallGPT, TokenData, args=args)
    checkpoints = cli.trainer.checkpoint_callback
    if cli.subcommand == "fit" and isinstance(checkpoints, ModelCheckpoint) and cli.trainer.is_global_zero:
        # ModelCheckpoint made a local dirpath absolute (against the working directory) at setup; every file is
        # committed once fit has returned.
        directory = checkpoints.dirpath
        if directory is not None and os.path.isdir(directory):
            names = ", ".join(sorted(os.listdir(directory))) or "none (no save step was reached)"
            print(f"checkpoints in {directory}: {names}")
        else:
            print(f"checkpoints in {directory}; the last one: {checkpoints.last_model_path or 'none'}")
    return cli


if __name__ == "__main__":
    main()
