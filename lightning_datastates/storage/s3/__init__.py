"""S3 storage: our own multipart driver on s3fs's async client, and concurrent ranged reads.

Commit protocol: ``begin`` creates a multipart upload; ``write_range`` (any order, several threads) sends every part
as soon as it has all its bytes, straight from the caller's memory where it holds the part whole; ``complete`` sends
``CompleteMultipartUpload``, which is the commit (S3 shows nothing under the key before it and the whole object
after it); ``abort`` (and any failure) sends ``AbortMultipartUpload``. A file of at most one part is sent as one
``PutObject`` at ``complete``. Details in :mod:`~lightning_datastates.storage.s3.session`.

Why not s3fs's own writer (see docs/design.md, "Why our own S3 writer"): ``with fs.open(p, "wb")`` commits what was
written when the block raises, and so does a garbage-collected file; its parts go one at a time; ``pipe_file`` wants
``bytes`` and fixed 50 MiB parts. Retries and timeouts are ours (:mod:`~lightning_datastates.storage.s3.client`).

Modules, one concern each:

* :mod:`~lightning_datastates.storage.s3.parts`: how a file is cut into parts, within S3's limits (pure);
* :mod:`~lightning_datastates.storage.s3.client`: the s3fs file systems, requests with retries and timeouts, errors;
* :mod:`~lightning_datastates.storage.s3.session`: one upload (:class:`S3WriteSession`);
* :mod:`~lightning_datastates.storage.s3.reads`: whole objects by concurrent ranged GETs, into memory or a memfd;
* :mod:`~lightning_datastates.storage.s3.markers`: the marker of each upload, and the clean-up of crashed runs';
* :mod:`~lightning_datastates.storage.s3.writer`: :class:`S3Writer`, tying them together.

s3fs is imported when an :class:`S3Writer` is built, so this package imports without it.
"""

from __future__ import annotations

from lightning_datastates.storage.s3.client import TUNABLES, S3Client, S3NotFoundError, S3WriteError
from lightning_datastates.storage.s3.markers import OPEN_UPLOADS, UPLOAD_MARKER_SUFFIX, MarkerInfo, UploadMarker
from lightning_datastates.storage.s3.parts import (
    MAX_OBJECT_BYTES,
    MAX_PART_BYTES,
    MAX_PARTS,
    MIN_PART_BYTES,
    PartPlan,
    plan_parts,
)
from lightning_datastates.storage.s3.reads import MAX_AUTO_RANGE_BYTES, fetch_into_memfd
from lightning_datastates.storage.s3.session import S3WriteSession
from lightning_datastates.storage.s3.writer import S3Writer

__all__ = [
    "MAX_AUTO_RANGE_BYTES",
    "MAX_OBJECT_BYTES",
    "MAX_PARTS",
    "MAX_PART_BYTES",
    "MIN_PART_BYTES",
    "OPEN_UPLOADS",
    "TUNABLES",
    "UPLOAD_MARKER_SUFFIX",
    "MarkerInfo",
    "PartPlan",
    "S3Client",
    "S3NotFoundError",
    "S3WriteError",
    "S3WriteSession",
    "S3Writer",
    "UploadMarker",
    "fetch_into_memfd",
    "plan_parts",
]
