"""``python -m lightning_datastates {verify,inspect,clean}``: see :mod:`lightning_datastates.cli`."""

import os
import sys

from lightning_datastates.cli import main

if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # output piped into `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
