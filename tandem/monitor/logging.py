"""The one logger of a tandem process: rich on a terminal, plain lines in files and pipes."""

from __future__ import annotations

import logging
import sys

_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"


def setup_logging(process: str, level: str = "INFO") -> logging.Logger:
    """Configure the root `tandem` logger once; returns the process's logger."""
    root = logging.getLogger("tandem")
    if not root.handlers:
        if sys.stderr.isatty():
            from rich.logging import RichHandler

            handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=False)
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        else:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(level)
    return logging.getLogger(f"tandem.{process}")
