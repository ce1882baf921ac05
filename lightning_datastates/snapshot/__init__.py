"""The snapshot engine (:mod:`.engine`, the steps capture -> copy -> write -> commit), with what it keeps on the way:
the pending checkpoints (:mod:`.pending`), its threads (:mod:`.threads`), the job state machine (:mod:`.job`) and the
back-pressure warning (:mod:`.backpressure`). No Lightning, no file formats."""
