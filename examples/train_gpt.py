"""Train a small GPT with lazy asynchronous checkpoints: the plugin, an unchanged ModelCheckpoint, a logger.

    python examples/train_gpt.py [--fast] [--dir DIR]

Every ``--every`` steps ModelCheckpoint saves; DataStatesIO snapshots the state while the next step computes and
writes the file in the background. What each checkpoint cost goes to the CSV logger under ``datastates/`` and a
one-line summary is printed when training ends.

Without ``--dir`` the checkpoints and the metrics go to a new temporary directory, removed at the end (the full run
writes 50 checkpoints, about 2.5 GB, in about two and a half minutes on a 2-core CPU); with ``--dir DIR`` they stay
in ``DIR``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import lightning as L
import torch
from gpt_data import small_gpt
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_datastates import DataStatesIO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="tiny model, 8 steps (for CI)")
    parser.add_argument(
        "--dir", default=None, help="output directory, kept (default: a new temporary one, removed at the end)"
    )
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps (default 4)")
    args = parser.parse_args()
    if args.dir:
        train(args, args.dir)
        return
    with tempfile.TemporaryDirectory(prefix="datastates-example-") as root:
        train(args, root)
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(root) for n in names)
        print(f"removing {root} ({size / 1e9:.2f} GB): give --dir DIR to keep the checkpoints and the metrics")


def train(args: argparse.Namespace, root: str) -> None:
    L.seed_everything(0, verbose=False)
    model, data = small_gpt(args.fast)

    plugin = DataStatesIO(host_cache="256MiB", writer_threads=2)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=8 if args.fast else 200,
        plugins=[plugin],  # the only change to a Lightning script
        callbacks=[
            ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"), every_n_train_steps=args.every, save_top_k=-1)
        ],
        logger=CSVLogger(root, name="logs"),
        enable_progress_bar=not args.fast,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)

    # Every file is committed when fit returns, and is a plain Lightning checkpoint.
    for stats in plugin.stats:
        print(
            f"{os.path.basename(stats.path)}: {stats.state}, {stats.total_bytes / 1e6:.1f} MB, "
            f"blocked {stats.blocked_s * 1e3:.1f} ms, durable after {stats.durable_s:.2f} s"
        )
    last = plugin.stats[-1].path
    step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
    print(f"{last} loads with torch.load: global_step={step}")
    print(f"metrics: {os.path.join(trainer.logger.log_dir, 'metrics.csv')}")


if __name__ == "__main__":
    main()
