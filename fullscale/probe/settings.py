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


def parse_iterations(text: str, key: str = "SKIP_ITERATIONS") -> frozenset:
    """Logged (1-based) iteration numbers from 'A-B C,D' (ranges inclusive)."""
    out = set()
    for tok in text.replace(",", " ").split():
        lo, sep, hi = tok.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ProbeError(f"{ENV_PREFIX}{key}: cannot read {tok!r} (want N or A-B, "
                             "logged iteration numbers)") from None
        if a < 1 or b < a:
            raise ProbeError(f"{ENV_PREFIX}{key}: {tok!r} is not a range of logged iterations "
                             "(1-based, A <= B)")
        out.update(range(a, b + 1))
    return frozenset(out)


def env_skip_iterations(env=None) -> frozenset:
    env = os.environ if env is None else env
    return parse_iterations(env.get(ENV_PREFIX + "SKIP_ITERATIONS", "") or "")
