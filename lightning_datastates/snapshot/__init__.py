"""The snapshot engine (:mod:`.engine`, the steps capture -> copy -> write -> commit), with what it keeps on the way:
the pending checkpoints (:mod:`.pending`), its threads (:mod:`.threads`) and the back-pressure warning
(:mod:`.backpressure`); the job state machine it drives is :mod:`~lightning_datastates.records.job`. No Lightning, no
file formats."""
