"""Tiered checkpoints (``DataStatesIO(local_tier=...)``): each checkpoint committed on node-local storage first, then
copied to its persistent path (the ``ModelCheckpoint`` directory: S3, Lustre, any storage the plugin writes) behind
training.

- :mod:`~lightning_datastates.tiered.layout`: where the local copy of a persistent path lives, and the markers that
  say a local copy is not yet replicated;
- :mod:`~lightning_datastates.tiered.replicator`: the copies to the persistent tier, on their own threads;
- :mod:`~lightning_datastates.tiered.retention`: which local copies go once replicated;
- :mod:`~lightning_datastates.tiered.tiers`: what the pipeline calls (save, load, remove, recovery, "last").

Imports :mod:`~lightning_datastates.snapshot`, :mod:`~lightning_datastates.load`, :mod:`~lightning_datastates.storage`
and :mod:`~lightning_datastates.records`; only the pipeline imports it.
"""
