"""Reads run directories and foreign logs; spike detection, fits to theory, reports."""

from adamspike.rundir import Run, RunFormatError, load_run
from analysis.spikes import RollingSpikeDetector, detect_spikes, spike_score_olmo2, zscore_flags

__all__ = ["Run", "RunFormatError", "load_run", "RollingSpikeDetector", "detect_spikes",
           "spike_score_olmo2", "zscore_flags"]
