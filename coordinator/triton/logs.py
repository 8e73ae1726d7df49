"""Python log lines of a Triton Python-backend model into Triton's log."""

from __future__ import annotations

import logging


def log_to_stderr(name: str) -> None:
    """INFO lines of logger ``name`` (and its children) into the stub's stderr,
    which Triton's log carries; without a handler Python would drop everything
    below WARNING."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # a root handler of the stub's, if any, would print each line again
