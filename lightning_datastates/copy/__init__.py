"""Copy: training state into the host arena (:mod:`.arena`), by the copier (:mod:`.copier`), sharing earlier copies
of the same state between checkpoints (:mod:`.sharing`)."""
