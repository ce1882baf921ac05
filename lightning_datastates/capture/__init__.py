"""Capture, on the training thread: plan the file's bytes (:mod:`.layout`, over the segment arithmetic of
:mod:`.segments` and the verified structures of :mod:`.verified`; with its ``torch.save`` fallback and the planning of
the lazy copies, :mod:`.planning`), admit the checkpoint into the host arena (:mod:`.admission`), and cut the copy into
chunks (:mod:`~lightning_datastates.records.chunks`)."""
