"""The probe's error type and its settings from the environment (ADAMSPIKE_PROBE_*)."""

from __future__ import annotations

import os


ENV_PREFIX = "ADAMSPIKE_PROBE_"


class ProbeError(RuntimeError):
    """The probe cannot read this optimizer / model (named in the message)."""


class _NeedsCluster(ProbeError):
    """An action needs the cluster extra's pandas (adamspike.spikes / .predictions)."""


def _env_int(key: str, default: int) -> int:
    v = os.environ.get(ENV_PREFIX + key)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise ProbeError(f"{ENV_PREFIX}{key} must be an integer, got {v!r}") from None


def _env_flag(key: str, default: bool) -> bool:
    v = os.environ.get(ENV_PREFIX + key)
    if v is None or v == "":
        return default
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ProbeError(f"{ENV_PREFIX}{key} must be 0 or 1, got {v!r}")
