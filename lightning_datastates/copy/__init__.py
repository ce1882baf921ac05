"""Copy: training state into the host arena (:mod:`.arena`, sized by :mod:`.sizing`, page-locked in the background by
:mod:`.pinning`), by the copiers (:mod:`.copier`) on the copier thread (:mod:`.loop`), sharing earlier copies of the
same state between checkpoints (:mod:`.sharing`)."""
