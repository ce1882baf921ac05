"""Capture, on the training thread: plan the file's bytes (:mod:`.layout`) and the copy's chunks (:mod:`.chunks`)."""
