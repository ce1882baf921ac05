"""``--datastates NAME=VALUE`` pairs as keyword arguments of ``DataStatesIO``: read by the parent process (to fail
early on a malformed pair) and by each worker subprocess (to build the plugin)."""

from __future__ import annotations

from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML comes with lightning; no stubs needed here


def datastates_options(pairs: list[str]) -> dict[str, Any]:
    """``["writer_threads=2", "chunk_size=32MiB", "serve_from_memory=false"]`` ->
    ``{"writer_threads": 2, "chunk_size": "32MiB", "serve_from_memory": False}``: values read as in a yaml config."""
    options: dict[str, Any] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--datastates expects NAME=VALUE, got {pair!r}")
        options[name.strip()] = yaml.safe_load(value) if value.strip() else ""
    return options
