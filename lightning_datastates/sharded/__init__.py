"""Sharded checkpoints (FSDP, ModelParallel) through ``torch.distributed.checkpoint``, lazily, on every rank.

The path of one sharded save, and where each step lives:

1. **stage** (training thread, every rank, no collective): :mod:`~lightning_datastates.sharded.staging` makes DCP's
   local plan of the rank's state and plans the rank's file (:mod:`~lightning_datastates.sharded.layout`), whose
   items' places are known before any byte is copied;
2. **copy and write** (engine threads, every rank): the snapshot engine copies the rank's shards into its host arena
   while training goes on (the barrier before the optimizer step waits for them) and writes the file;
3. **plan and commit** (committer thread, :mod:`~lightning_datastates.sharded.commit`): DCP's own planning
   collectives, over a gloo group, from what each rank staged (:mod:`~lightning_datastates.sharded.dcp_writer`); once
   every rank's file is durable, rank 0 writes DCP's ``.metadata`` and then Lightning's ``meta.pt``; never before.

:mod:`~lightning_datastates.sharded.lightning` routes Lightning's sharded strategies here;
:mod:`~lightning_datastates.sharded.saver` runs one save; :mod:`~lightning_datastates.sharded.leftovers` finds and
removes what a run that died in flight left.
"""
