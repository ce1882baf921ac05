"""A checkpoint directory that can never take a checkpoint fails the run at setup, before the first training step, as
``CheckpointFlushError`` (the type the README names) with the storage error chained: a local ``dirpath`` that is a
file, an S3 bucket that does not exist, no S3 credentials (the message says which are missing and where they come
from, not "check the network"). Real Trainers, real files, moto's S3 server; no credentials: the ``AWS_*`` variables
unset and botocore's files pointed at empty ones.
"""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_datastates import DataStatesIO
from lightning_datastates.errors import CheckpointFlushError
from lightning_datastates.storage.s3 import S3WriteError
from tests.conftest import BNModel, make_loader, make_trainer
from tests.s3_server import clear_client_caches, s3_endpoint_fixture, s3_fixture  # noqa: F401 - fixtures


class _StepCountingModel(BNModel):
    """Counts the training steps that ran: none may, when setup fails."""

    steps = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        type(self).steps += 1
        return super().training_step(batch, batch_idx)


def _fit_fails_at_setup(tmp_path, plugin: DataStatesIO, dirpath: str, ckpt_path: str | None = None) -> Exception:
    _StepCountingModel.steps = 0
    checkpoint = ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_last=True)
    trainer = make_trainer(str(tmp_path), plugin, callbacks=[checkpoint], max_epochs=1)
    with pytest.raises(CheckpointFlushError) as raised:
        trainer.fit(_StepCountingModel(), make_loader(), ckpt_path=ckpt_path)
    assert _StepCountingModel.steps == 0, "a training step ran before the error"
    assert raised.value.path == dirpath
    return raised.value


def test_a_dirpath_that_is_a_file_fails_at_setup(tmp_path):
    (tmp_path / "taken").write_text("a file where the checkpoints were to go")
    dirpath = str(tmp_path / "taken" / "run")  # under a file: no directory can be made there
    error = _fit_fails_at_setup(tmp_path, DataStatesIO(), dirpath)
    assert isinstance(error.__cause__, NotADirectoryError)
    message = str(error)
    assert f"{tmp_path / 'taken'} is a file, not a directory" in message and "ModelCheckpoint(dirpath=...)" in message


def test_a_missing_bucket_fails_at_setup(tmp_path, s3):
    plugin = DataStatesIO(storage_options=s3.storage_options)
    error = _fit_fails_at_setup(tmp_path, plugin, "s3://no-such-bucket/run")
    assert isinstance(error.__cause__, S3WriteError)
    assert "bucket 'no-such-bucket' does not exist; create the bucket" in str(error)
    assert s3.keys() == []


@pytest.fixture
def no_credentials(tmp_path, monkeypatch, s3_endpoint):
    """No AWS credentials anywhere botocore looks: variables unset, its files empty, no instance metadata asked."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_DEFAULT_PROFILE",
    ):
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "empty-aws-file"
    empty.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no request to an instance metadata service
    for name in ("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    clear_client_caches()
    yield
    clear_client_caches()


@pytest.mark.parametrize("ckpt_path", [None, "last"])
def test_missing_credentials_fail_at_setup_saying_where_they_come_from(tmp_path, s3, no_credentials, ckpt_path):
    # ckpt_path="last" lists the directory before any callback's setup: it must fail the same way there.
    plugin = DataStatesIO(storage_options={"endpoint_url": s3.endpoint, "retries": 1})
    error = _fit_fails_at_setup(tmp_path, plugin, "s3://bucket/run", ckpt_path)
    assert isinstance(error.__cause__, S3WriteError)
    message = str(error)
    assert "NoCredentialsError" in message and "no AWS credentials were found" in message, message
    for source in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "storage_options key and secret", "AWS_PROFILE"):
        assert source in message, message
    assert "network" not in message and "raise storage_options" not in message, message
    assert s3.keys() == []
