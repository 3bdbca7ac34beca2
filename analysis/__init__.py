"""Reads run directories and foreign logs; spike detection, fits to theory, reports."""

from adamspike.rundir import Run, RunFormatError, load_run

__all__ = ["Run", "RunFormatError", "load_run"]
