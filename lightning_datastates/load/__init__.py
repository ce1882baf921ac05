"""Load: read a checkpoint back (:mod:`.reader`), check it (:mod:`.integrity`), or serve it from the host arena while
it is still there (:mod:`.resident`)."""
