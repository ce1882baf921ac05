"""The snapshot engine (:mod:`.engine`, the steps capture -> copy -> write -> commit), with what it keeps on the way:
the pending checkpoints (:mod:`.pending`), its threads (:mod:`.threads`), what capture plans (:mod:`.planning`) and the
job state machine (:mod:`.job`). No Lightning, no file formats."""
