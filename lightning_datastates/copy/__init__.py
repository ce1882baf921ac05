"""Copy: training state into the host arena (:mod:`.arena`), by the copiers (:mod:`.copier`) on the copier thread
(:mod:`.loop`), sharing earlier copies of the same state between checkpoints (:mod:`.sharing`)."""
