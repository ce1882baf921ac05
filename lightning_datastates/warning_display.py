"""How this package's warnings look on screen: one line, above the progress bar.

Python shows a warning as ``<file>:<line>: <Category>: <message>`` followed by the source line that raised it, written
straight to stderr. For a user that is noise (the file and source line are ours, not theirs), and under Lightning's
tqdm progress bar the write tears the bar's line. :func:`show_warnings_plainly` shows the warnings of this package's
own categories (``BackPressureWarning``, ``PluginBypassedWarning``) as ``lightning_datastates: <Category>: <message>``,
written with tqdm's ``write`` (Lightning's bar is tqdm's), which clears the bars, writes the line and draws them
again. Every other warning is shown as before, and the warning filters (``-W``, ``warnings.filterwarnings``, pytest's
capture) apply as always: this replaces only the display, ``warnings.showwarning``, which ``warnings.catch_warnings``
saves and restores.

Call order: :func:`show_warnings_plainly` when a plugin is made (any thread; idempotent); the display runs wherever
a warning is shown.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, TextIO

from lightning_datastates.compat.lightning import Tqdm

#: Marks the display installed here, so that it is installed once (and not around itself).
_MARK = "_lightning_datastates_display"
_PACKAGE = "lightning_datastates"


def show_warnings_plainly() -> None:
    """Show this package's warnings as one line above any progress bar, from now on (see the module docstring)."""
    previous = warnings.showwarning
    if getattr(previous, _MARK, False):
        return

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if not is_ours(category):
            previous(message, category, filename, lineno, file, line)
            return
        try:
            Tqdm.write(plain_warning(message, category), file=file or sys.stderr)
        except (OSError, ValueError):  # a closed or missing stream: Python's own display drops the warning the same way
            pass

    setattr(showwarning, _MARK, True)
    warnings.showwarning = showwarning


def is_ours(category: type[Warning]) -> bool:
    """Whether ``category`` is one of this package's warning classes."""
    module: Any = getattr(category, "__module__", "")
    return isinstance(module, str) and (module == _PACKAGE or module.startswith(_PACKAGE + "."))


def plain_warning(message: Warning | str, category: type[Warning]) -> str:
    """The one line shown for a warning of this package: no file, no line number, no source line."""
    return f"{_PACKAGE}: {category.__name__}: {message}"
