"""Suite-wide settings.

The torch telemetry kernels run eagerly in the suite (ADAMSPIKE_TELEMETRY_COMPILE=off):
compiling them costs ~5 s per process and the suite starts dozens of short trainings.
tests/fullscale/test_telemetry.py asks for compile = "on" explicitly where it checks the
compiled kernels against the numpy reference and a compiled training run."""

import os

os.environ.setdefault("ADAMSPIKE_TELEMETRY_COMPILE", "off")
