"""Any fsspec target through the generic writer, in a real Trainer (fsspec's memory file system)."""

from __future__ import annotations

from pathlib import Path

import fsspec
import torch

from lightning_datastates import DataStatesIO
from lightning_datastates.compat.lightning import checkpoint_path_str
from lightning_datastates.storage.local import TEMP_SUFFIX
from tests.conftest import (
    BNModel,
    RecordingDataStatesIO,
    assert_bit_equal,
    every_step_checkpoint,
    make_loader,
    make_trainer,
)


def test_trainer_round_trip_through_memory_filesystem(tmp_path, slow_copies):
    fs = fsspec.filesystem("memory")
    root = f"memory://{tmp_path.name}/ckpt"
    torch.manual_seed(0)
    plugin = RecordingDataStatesIO(chunk_size="64KiB")
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[every_step_checkpoint(root)], max_epochs=1)
    trainer.fit(BNModel(), make_loader())
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"/{tmp_path.name}/ckpt", detail=False))
    assert names == sorted([f"epoch=0-step={i}.ckpt" for i in range(1, 9)] + ["last.ckpt"])
    assert not [n for n in fs.find("/") if n.endswith(TEMP_SUFFIX)]
    for path, expected in plugin.recorded.items():
        assert_bit_equal(plugin.load_checkpoint(path, weights_only=False), expected, path)

    resumed = make_trainer(str(tmp_path), DataStatesIO(), max_epochs=2, enable_checkpointing=False)
    resumed.fit(BNModel(), make_loader(), ckpt_path=f"{root}/last.ckpt")
    assert resumed.global_step == 16
    plugin.remove_checkpoint(f"{root}/last.ckpt")
    assert not fs.exists(f"/{tmp_path.name}/ckpt/last.ckpt")


def test_pathlib_collapsed_urls_are_restored():
    assert checkpoint_path_str(Path("s3://bucket/run/last.ckpt")) == "s3://bucket/run/last.ckpt"
    assert checkpoint_path_str(Path("/local/dir/a.ckpt")) == "/local/dir/a.ckpt"
    assert checkpoint_path_str("s3://bucket/key") == "s3://bucket/key"
