"""The snapshot engine: host arena, copiers and the job state machine (no Lightning, no file formats)."""
