"""The floor of the package: the records and names every stage shares and hands on.

What one checkpoint is on its way to storage: the job and its state machine (:mod:`.job`), the file's byte layout
(:mod:`.layout`), its copy chunks and their pieces (:mod:`.chunks`), the arena block a chunk lands in (:mod:`.block`),
the writer threads' tasks (:mod:`.tasks`), the write-through gate (:mod:`.through`), the write session it goes into
(:mod:`.session`, the write side of the storage seam) and the CRC-32s computed on the way (:mod:`.checksums`); and the
names that make a directory a sharded checkpoint (:mod:`.names`).

Every stage (capture, copy, load, write, snapshot), the storage backends and the compatibility layer import these;
they import nothing else of the package but :mod:`~lightning_datastates.alignment` (a leaf: the page-alignment rule).
See ``docs/design.md`` ("Floors: which folder may import which") for which folder may import which.
"""
