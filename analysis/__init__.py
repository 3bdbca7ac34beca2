"""Reads run directories and foreign logs; spike detection, fits to theory, reports."""

from adamspike.rundir import Run, RunFormatError, load_run
from analysis.megatron_log import import_megatron_log, read_megatron_log
from analysis.report import analyze_run, write_run_report
from analysis.spikes import RollingSpikeDetector, detect_spikes, spike_score_olmo2, zscore_flags

__all__ = ["Run", "RunFormatError", "load_run", "RollingSpikeDetector", "detect_spikes",
           "spike_score_olmo2", "zscore_flags", "import_megatron_log", "read_megatron_log",
           "analyze_run", "write_run_report"]
