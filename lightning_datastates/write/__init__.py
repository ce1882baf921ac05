"""Write: writer threads (:mod:`.loop`) take tasks (:mod:`.tasks`) and write chunks from the host arena (or straight
from host tensors, :mod:`.through`) into a storage session, with the CRC-32 of every record computed on the way
(:mod:`.checksums`), then commit the file."""
