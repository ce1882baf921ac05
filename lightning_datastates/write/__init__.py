"""Write: writer threads (:mod:`.loop`) take tasks (:mod:`~lightning_datastates.records.tasks`) and write chunks from
the host arena (or straight from host tensors, :mod:`~lightning_datastates.records.through`) into a storage session,
with the CRC-32 of every record computed on the way (:mod:`~lightning_datastates.records.checksums`), then commit the
file."""
