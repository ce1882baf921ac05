"""Checkpoint to S3 (or any S3-compatible store) and load the result back.

    python3 -m pip install 'lightning-datastates[s3]'
    python examples/s3_checkpoints.py s3://my-bucket/my-run [--endpoint-url URL] [--fast]

Credentials come from the standard AWS variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION);
the endpoint from ``--endpoint-url`` or AWS_ENDPOINT_URL. Each checkpoint is one multipart upload whose parts are
sent while training goes on; it becomes visible only when CompleteMultipartUpload succeeds, so an object under a
checkpoint's name is always complete.
"""

from __future__ import annotations

import argparse

import lightning as L
from gpt_data import small_gpt
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("url", help="where the checkpoints go, e.g. s3://my-bucket/my-run")
    parser.add_argument("--endpoint-url", default=None, help="an S3-compatible endpoint (default: AWS_ENDPOINT_URL)")
    parser.add_argument("--fast", action="store_true", help="tiny model, 8 steps (for CI)")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    model, data = small_gpt(args.fast)

    storage_options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
    plugin = DataStatesIO(
        host_cache="256MiB",
        # The multipart writer's own settings ride along with s3fs's options.
        storage_options={**storage_options, "part_size_bytes": "8MiB", "max_concurrent_parts": 8},
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=8 if args.fast else 200,
        plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=args.url, every_n_train_steps=4, save_top_k=2, monitor="step", mode="max")],
        logger=False,
        enable_progress_bar=not args.fast,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data)

    # Loaded back through the plugin (concurrent ranged GETs); the objects are plain checkpoints for torch.load too.
    for stats in plugin.stats:
        print(f"{stats.path}: {stats.state}, {stats.total_bytes / 1e6:.1f} MB, blocked {stats.blocked_s * 1e3:.1f} ms")
    checkpoint = plugin.load_checkpoint(plugin.stats[-1].path, map_location="cpu", weights_only=True)
    print(f"loaded {plugin.stats[-1].path}: global_step={checkpoint['global_step']}")


if __name__ == "__main__":
    main()
