"""The analysis plans of docs/plan/: read, hashed, and ordered by version.

A plan is a TOML file written and committed before the runs it governs
(docs/plan/<name>_v<version>.toml). Its sha256 (of the file's bytes) is printed wherever
its verdicts are (STUDY.md); a change after the data is a new version whose [plan] table
names what it supersedes and why, and reports keep every version's result.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from adamspike.claims import REPO
from adamspike.config import ConfigError, read_toml

PLAN_DIR = REPO / "docs" / "plan"


def plan_path(name: str = "science4", version: int | None = None) -> Path:
    """The file of a plan version (the newest when version is None)."""
    found = {}
    for p in PLAN_DIR.glob(f"{name}_v*.toml"):
        m = re.fullmatch(rf"{re.escape(name)}_v(\d+)\.toml", p.name)
        if m:
            found[int(m.group(1))] = p
    if not found:
        raise ConfigError(f"no plan {name!r} under {PLAN_DIR}")
    if version is None:
        version = max(found)
    if version not in found:
        raise ConfigError(f"plan {name!r}: no version {version} (have {sorted(found)})")
    return found[version]


def load_plan(name: str = "science4", version: int | None = None) -> dict[str, Any]:
    """The plan as a dict, with `_path` and `_sha256` (of the file's bytes) added."""
    p = plan_path(name, version)
    data = read_toml(p)
    meta = data.get("plan", {})
    if meta.get("name") != name or int(meta.get("version", -1)) != int(
            re.search(r"_v(\d+)\.toml$", p.name).group(1)):
        raise ConfigError(f"{p}: [plan] name / version do not match the file name")
    data["_path"] = str(p)
    data["_sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
    return data


def plan_history(name: str = "science4") -> list[dict[str, Any]]:
    """Every version of a plan, oldest first (each as load_plan returns it): a report lists
    them all, so a result under an older version stays readable beside the newer one."""
    versions = sorted(int(m.group(1)) for p in PLAN_DIR.glob(f"{name}_v*.toml")
                      if (m := re.fullmatch(rf"{re.escape(name)}_v(\d+)\.toml", p.name)))
    return [load_plan(name, v) for v in versions]
