"""One checkpoint going up to S3 as a multipart upload (or one ``PutObject``): the session of the S3 writer.

The file is cut into parts of fixed byte ranges ``[i*P, (i+1)*P)`` (:mod:`~lightning_datastates.storage.s3.parts`);
``write_range`` (any order, several threads) uploads every part its range holds whole straight from the caller's
memory (the host arena: no copy) and returns once those parts are stored; the bytes of parts it covers only in part
are copied into per-part pieces, and the moment such a part has all its bytes its ``upload_part`` is scheduled. Part
uploads run on s3fs's event loop, at most ``max_concurrent_parts`` at a time; ``complete`` waits for every part and
sends ``CompleteMultipartUpload`` with the ETags in part order. S3 shows nothing under the key before that call and
the whole object after it, so it is the commit. ``abort`` (and any failure) sends ``AbortMultipartUpload``: an open
upload is invisible but billed. A file of at most one part (an empty one too) is sent as one ``PutObject`` at
``complete`` instead.

Memory: a session holds only copies of partly received parts not yet uploaded, plus the bodies of the parts being
sent; a part's body is assembled when its last byte arrives. Whole parts are read from the caller's buffer in place,
which the caller keeps until ``write_range`` returns (the engine frees an arena block only then). ``write_range``
also waits (back-pressure) while more than ``2 * max_concurrent_parts`` complete parts are queued for upload; it
never waits for incomplete parts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

import fsspec.asyn

from lightning_datastates.config import DEFAULT_STALE_AGE_S
from lightning_datastates.records.session import WriteSession
from lightning_datastates.storage.s3.client import S3Client, S3WriteError
from lightning_datastates.storage.s3.markers import OPEN_UPLOADS, UploadMarker, drop_marker
from lightning_datastates.storage.s3.parts import PartPlan
from lightning_datastates.streams import BufferReader

log = logging.getLogger("lightning_datastates")

_OPEN, _COMPLETING, _COMPLETED, _ABORTED = "open", "completing", "completed", "aborted"


class S3WriteSession(WriteSession):
    """One checkpoint going up to S3; see the module docstring.

    Thread model: ``write_range`` from several writer threads at once; ``complete`` or ``abort`` from one thread
    after the last ``write_range`` returned; part uploads run as tasks on s3fs's event loop.

    Args:
        client: the writer's client (requests, retries, timeouts, event loop).
        max_concurrent_parts: parts uploaded at once; ``write_range`` waits while twice as many are queued.
        upload_id: the multipart upload (None for a file of at most one part, sent by ``PutObject``).
        marker: the upload's marker object (see :mod:`~lightning_datastates.storage.s3.markers`).
    """

    def __init__(
        self,
        client: S3Client,
        max_concurrent_parts: int,
        path: str,
        bucket: str,
        key: str,
        plan: PartPlan,
        upload_id: str | None,
        marker: UploadMarker | None = None,
    ):
        self.path = path
        self.bucket = bucket
        self.key = key
        self.plan = plan
        self.upload_id = upload_id
        self.marker = marker
        self._client = client
        self._max_concurrent_parts = max_concurrent_parts
        self._cond = threading.Condition()
        self._state = _OPEN
        self._pieces: dict[int, list[tuple[int, bytes]]] = {}  # part -> (offset in part, bytes) received so far
        self._received = [0] * plan.count
        self._futures: dict[int, concurrent.futures.Future[str | None]] = {}
        self._etags: dict[int, str] = {}
        self._queued = 0  # parts scheduled for upload and not yet finished
        self._error: BaseException | None = None  # first failed part
        self._aborting = False  # read by part tasks on the event loop
        self._tasks: set[asyncio.Task[Any]] = set()  # part tasks running on the loop (touched only there)
        self._semaphore = asyncio.Semaphore(max_concurrent_parts)  # binds to the loop at first use

    # ------------------------------------------------------------------ writer threads
    def write_range(self, offset: int, data: memoryview) -> None:
        """Upload every part that ``data`` holds whole straight from ``data`` (no copy) and return once they are
        stored; copy the bytes of parts it covers only in part into their pieces, and schedule every part those
        complete.

        Raises:
            S3WriteError: a part upload failed (naming the path and the part).
            RuntimeError: the session already ended.
            ValueError: the range lies outside the file or overlaps bytes already written.
        """
        view = memoryview(data).cast("B")
        end = offset + view.nbytes
        if offset < 0 or end > self.plan.total_bytes:
            raise ValueError(f"{self.path}: range [{offset}, {end}) outside a file of {self.plan.total_bytes} bytes")
        self._wait_for_room()
        part_bytes = self.plan.part_bytes
        position = offset
        ready: list[tuple[int, bytes | bytearray | memoryview]] = []
        borrowed: list[int] = []  # parts sent from the caller's memory: waited for before returning
        while position < end:
            index = position // part_bytes
            stop = min(end, (index + 1) * part_bytes)
            length = self.plan.length(index)
            whole = position == index * part_bytes and stop - position == length and self.plan.multipart
            # A partial piece is copied: the caller reuses its buffer as soon as this returns.
            piece = view[position - offset : stop - offset] if whole else bytes(view[position - offset : stop - offset])
            with self._cond:
                self._check_open()
                self._received[index] += len(piece)
                if self._received[index] > length:
                    raise ValueError(f"{self.path}: overlapping writes in part {index + 1}")
                if whole:
                    ready.append((index, piece))
                    borrowed.append(index)
                else:
                    self._pieces.setdefault(index, []).append((position - index * part_bytes, piece))  # type: ignore[arg-type]
                    if self._received[index] == length and self.plan.multipart:
                        ready.append((index, _assemble(length, self._pieces.pop(index))))
            position = stop
        for index, body in ready:
            self._schedule(index, body)
        if borrowed:
            with self._cond:
                futures = [self._futures[i] for i in borrowed if i in self._futures]
            concurrent.futures.wait(futures)  # bounded: every attempt has a timeout; abort cancels them
            with self._cond:
                self._raise_part_error()
                self._check_open()

    def _wait_for_room(self) -> None:
        """Back-pressure: wait while too many complete parts are queued (those always finish, by timeouts)."""
        with self._cond:
            while self._queued > 2 * self._max_concurrent_parts and self._error is None:
                self._check_open()
                self._cond.wait(1.0)
            self._raise_part_error()
            self._check_open()

    def _schedule(self, index: int, body: bytes | bytearray | memoryview) -> None:
        with self._cond:
            if self._state == _ABORTED:
                return  # aborted meanwhile: the part would only be refused
            self._queued += 1
            upload = self._upload_part(index, body, self.upload_id)
            future = self._client.submit(upload)
            self._futures[index] = future
        # Outside the lock: a future already done runs the callback right here, and the callback takes the lock.
        future.add_done_callback(lambda done: self._part_done(index, done))

    # ------------------------------------------------------------------ event loop
    async def _upload_part(self, index: int, body: bytes | bytearray | memoryview, upload_id: str | None) -> str | None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            async with self._semaphore:  # the window of concurrent parts
                if self._aborting:
                    return None
                number = index + 1
                response = await self._client.with_retries(
                    f"uploading part {number}/{self.plan.count} of {self.path}",
                    lambda: self._client.call(
                        "upload_part",
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=upload_id,
                        PartNumber=number,
                        # botocore takes bytes or a file, not a memoryview: a reader over the caller's memory, new
                        # for every attempt (a retry reads from the start).
                        Body=BufferReader(body) if isinstance(body, memoryview) else body,
                    ),
                    nbytes=len(body),
                )
                return str(response["ETag"])
        finally:
            self._tasks.discard(task)

    def _part_done(self, index: int, future: concurrent.futures.Future[str | None]) -> None:
        with self._cond:
            self._queued -= 1
            if not future.cancelled():
                error = future.exception()
                if error is not None:
                    if self._error is None and not self._aborting:
                        self._error = error
                        self._aborting = True  # the commit cannot happen now: queued parts need not be sent
                elif future.result() is not None:
                    self._etags[index] = future.result()  # type: ignore[assignment]
            self._cond.notify_all()

    async def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # ------------------------------------------------------------------ commit / abort
    def complete(self) -> None:
        """Wait for every part, then ``CompleteMultipartUpload`` (or one ``PutObject`` for a small file).

        Raises:
            S3WriteError: a part or the commit failed; the upload is aborted and nothing became visible.
            RuntimeError: the session already ended.
        """
        with self._cond:
            if self._state != _OPEN:
                raise RuntimeError(f"{self.path}: session already ended")
            self._state = _COMPLETING
            futures = list(self._futures.values())
        try:
            missing = self.plan.total_bytes - sum(self._received)
            if missing:
                raise S3WriteError(f"{self.path}: {missing} bytes were never written; not committing")
            if not self.plan.multipart:
                body = _assemble(self.plan.total_bytes, self._pieces.pop(0, []))
                self._client.run(
                    f"uploading {self.path}",
                    lambda: self._client.call("put_object", Bucket=self.bucket, Key=self.key, Body=body),
                    nbytes=len(body),
                )
            else:
                concurrent.futures.wait(futures)  # bounded: every attempt of every part has a timeout
                with self._cond:
                    self._raise_part_error()
                    parts = [{"PartNumber": i + 1, "ETag": self._etags[i]} for i in range(self.plan.count)]
                self._client.run(
                    f"committing {self.path}",
                    lambda: self._client.call(
                        "complete_multipart_upload",
                        Bucket=self.bucket,
                        Key=self.key,
                        UploadId=self.upload_id,
                        MultipartUpload={"Parts": parts},
                    ),
                    nbytes=self.plan.total_bytes,  # S3 assembles the parts meanwhile (it keeps the answer alive)
                )
                OPEN_UPLOADS.discard(self.upload_id)
                self._drop_marker()
            with self._cond:
                self._state = _COMPLETED
        except BaseException:
            with self._cond:
                self._state = _ABORTED
                self._cond.notify_all()
            try:
                self._abort_upload()
            except Exception:  # the failure that stopped the commit is the one to raise
                log.exception(
                    "lightning_datastates: could not abort the multipart upload of %s (its parts are stored, and "
                    "billed, until aborted); the next run's setup aborts it once an hour old",
                    self.path,
                )
            raise
        finally:
            self._pieces.clear()
            self._client.invalidate(self.path)

    def abort(self) -> None:
        """Stop and cancel part uploads, then ``AbortMultipartUpload``; safe to call more than once.

        Raises:
            S3WriteError: the abort request failed (the open upload is removed later by ``clean_stale``).
        """
        with self._cond:
            if self._state in (_ABORTED, _COMPLETED):
                return  # after a commit, abort must not touch the committed object
            self._state = _ABORTED
            self._pieces.clear()
            self._cond.notify_all()
        self._abort_upload()

    def _abort_upload(self) -> None:
        self._aborting = True  # queued parts return at once; failures from here on are expected
        upload_id, self.upload_id = self.upload_id, None
        if upload_id is None:
            return
        with self._cond:
            futures = list(self._futures.values())
        # Parts still running would land after the abort (S3 then keeps them, billed): cancel them and wait.
        fsspec.asyn.sync(self._client.loop, self._cancel_tasks)
        concurrent.futures.wait(futures, timeout=self._client.timeout_s)
        try:
            # Run as its own task on the loop: an interrupted caller (or cancelled part tasks) cannot stop it.
            self._client.run(
                f"aborting the upload of {self.path}",
                lambda: self._client.call(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id
                ),
                missing_ok=True,
            )
        except S3WriteError as exc:
            raise S3WriteError(
                f"{exc}; multipart upload {upload_id} stays open until clean_stale removes it (once this process "
                f"ended, or after {DEFAULT_STALE_AGE_S / 3600:g} h from another host)"
            ) from exc.__cause__
        else:
            self._drop_marker()  # only once the upload is gone: the marker tells clean_stale whose upload it is
        finally:
            OPEN_UPLOADS.discard(upload_id)
            with self._cond:
                self._futures.clear()

    def _drop_marker(self) -> None:
        """Delete the upload's marker (best effort: ``clean_stale`` removes markers left behind)."""
        marker, self.marker = self.marker, None
        if marker is None:
            return
        try:
            drop_marker(self._client, self.path, self.bucket, marker)
        except Exception:
            log.warning("lightning_datastates: could not remove the upload marker of %s", self.path, exc_info=True)

    # ------------------------------------------------------------------ helpers (call with the lock held)
    def _check_open(self) -> None:
        if self._state != _OPEN:
            raise RuntimeError(f"write to {self.path} after its session ended")

    def _raise_part_error(self) -> None:
        if self._error is not None:
            raise S3WriteError(str(self._error)) from self._error


def _assemble(length: int, pieces: list[tuple[int, bytes]]) -> bytes | bytearray:
    """A part's body from its pieces (no copy when one piece is the whole part)."""
    if len(pieces) == 1 and len(pieces[0][1]) == length:
        return pieces[0][1]
    body = bytearray(length)
    for offset, piece in pieces:
        body[offset : offset + len(piece)] = piece
    return body
