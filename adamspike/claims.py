"""The one claim schema: a claims TOML file, checked (no jax, no pandas).

A claims file is a study (docs/design.md, "Claims: one system"):

    [study]           title, description, seeds (paired seeds per arm, >= 10)
    [base.<name>]     problem = a simulate.sweep_problems problem (the "sweep" runner), or
                      config = a RunConfig TOML (the "seeds" runner: tiny LLaMA, vmapped seeds);
                      overrides: dotted keys; calibrate = {rounds, seeds}: per-group eps
                      calibrated to a ladder's 70B rho
    [arms]            optional names: <name> = {dotted overrides}
    [[claim]]         id, source, claim, base, treatment, control (dicts of dotted keys over
                      the base, or names of [arms]; no control = a one-cell claim), metric,
                      rule (RULES), arg (X of at_least, [a, b] of within), experiment, note,
                      only_spiking, also (more metrics: arm means in the note)

The file holds the full study. A caller gives it other sizes with `--set base.NAME.KEY=VALUE`
(`read_study(path, sets)`: e.g. base.matched.overrides.train.num_steps=40) and runs a subset
of its claims with `--only ID` (the others are listed as not run): the study's size table,
configs/study.toml, does both.
An override value "*k" multiplies the base's value (the calibrated eps of the matched base).
Running the arms is simulate.claims; the verdicts and the report are analysis.claims.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from adamspike.config import ConfigError, apply_sets, flatten, read_toml

REPO = Path(__file__).resolve().parent.parent
RULES = {
    "decrease": "p_holm < alpha and CI of (treatment - control) entirely < 0",
    "increase": "p_holm < alpha and CI of (treatment - control) entirely > 0",
    "removes": "every treatment run at 0, p_holm < alpha and CI of (treatment - control) entirely < 0",
    "weak": "CI of (treatment - control) inside +-0.5 x control mean",
    "at_least": "p_holm < alpha and CI of the mean entirely > {x}",
    "within": "CI of the mean inside [{a}, {b}]",
}
CLAIM_FIELDS = {"id", "source", "claim", "base", "treatment", "control", "metric", "rule", "arg",
                "experiment", "note", "only_spiking", "also"}
BASE_FIELDS = {"problem", "config", "overrides", "calibrate"}
MIN_SEEDS = 10


@dataclass
class Claim:
    id: str
    source: str
    claim: str
    base: str
    metric: str
    rule: str
    treatment: dict
    control: dict | None = None        # None: one-cell claim
    treatment_name: str = ""
    control_name: str = ""
    arg: Any = None
    experiment: str = ""
    note: str = ""
    only_spiking: bool = False
    also: tuple = ()

    def rule_text(self) -> str:
        a = self.arg if isinstance(self.arg, (list, tuple)) else (None, None)
        return RULES[self.rule].format(x=f"{self.arg:.3g}" if self.rule == "at_least" else "",
                                       a=a[0], b=a[1])


@dataclass
class Study:
    path: str
    title: str
    description: str
    seeds: int
    bases: dict[str, dict]
    claims: list[Claim] = field(default_factory=list)
    spike_k: float | None = None     # the spike rule's MAD multiple (None: the project's)
    sets: tuple = ()                 # the `--set` values applied to the file


def arm_label(overrides: Mapping[str, Any], name: str = "") -> str:
    """An arm's name in tables: its [arms] name, else its overrides (or "base")."""
    return name or ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "base"


def resolve(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict:
    """base + overrides; a value "*k" multiplies the base's value."""
    out = dict(base)
    for k, v in overrides.items():
        if isinstance(v, str) and v.startswith("*"):
            if k not in out:
                raise ConfigError(f"{k}: {v!r} multiplies the base's value, which has none")
            v = float(out[k]) * float(v[1:])
        out[k] = v
    return out


def read_study(path: str | Path, sets: tuple | list = ()) -> Study:
    """A claims file with `--set base.NAME.KEY=VALUE` applied, checked: fields, bases, arm
    names, rules (ConfigError names the table and the field). The runners check the dotted
    keys themselves (simulate.claims)."""
    data = read_toml(path)
    if sets:
        data = apply_sets(data, sets, {"base"})
    bad = sorted(set(data) - {"study", "base", "arms", "claim"})
    if bad or not data.get("claim") or not data.get("base"):
        raise ConfigError(f"{path}: expected [study], [base.<name>], [arms] and [[claim]] tables"
                          + (f" (unknown {bad[0]!r})" if bad else ""))
    st = data.get("study", {})
    bases = data["base"]
    for name, b in bases.items():
        extra = sorted(set(b) - BASE_FIELDS)
        if extra or ("problem" in b) == ("config" in b):
            raise ConfigError(f"{path}: base.{name}: " + (f"unknown field {extra[0]!r}" if extra
                              else "needs exactly one of problem / config"))
    arms = {k: flatten(v) for k, v in data.get("arms", {}).items()}
    claims, seen = [], set()
    for i, row in enumerate(data["claim"]):
        where = f"{path}: claim[{i}]"
        extra = sorted(set(row) - CLAIM_FIELDS)
        if extra:
            raise ConfigError(f"{where}.{extra[0]}: unknown field (known: {', '.join(sorted(CLAIM_FIELDS))})")
        row = dict(row)
        if "base" not in row and len(bases) == 1:
            row["base"] = next(iter(bases))
        for k in ("id", "source", "claim", "base", "metric", "rule", "treatment"):
            if k not in row:
                raise ConfigError(f"{where}.{k}: missing")
        where = f"{path}: claim {row['id']}"
        if row["id"] in seen:
            raise ConfigError(f"{where}.id: duplicate")
        seen.add(row["id"])
        if row["base"] not in bases:
            raise ConfigError(f"{where}.base: unknown {row['base']!r} (known: {', '.join(bases)})")
        if row["rule"] not in RULES:
            raise ConfigError(f"{where}.rule: unknown {row['rule']!r} (known: {', '.join(RULES)})")
        names = {}
        for arm in ("treatment", "control"):
            v = row.get(arm)
            if isinstance(v, str):
                if v not in arms:
                    raise ConfigError(f"{where}.{arm}: unknown arm {v!r} (known: {', '.join(arms)})")
                names[f"{arm}_name"], row[arm] = v, arms[v]
            elif v is not None:
                row[arm] = flatten(v)
        if isinstance(row.get("arg"), list):
            row["arg"] = tuple(row["arg"])
        claims.append(Claim(**{**row, **names, "also": tuple(row.get("also", ()))}))
    seeds = int(st.get("seeds", MIN_SEEDS))
    bad = sorted(set(st) - {"title", "description", "seeds", "spike_k"})
    if bad:
        raise ConfigError(f"{path}: study.{bad[0]}: unknown field")
    k = st.get("spike_k")
    if k is not None and not (isinstance(k, (int, float)) and k > 0):
        raise ConfigError(f"{path}: study.spike_k: a positive number, got {k!r}")
    return Study(str(path), st.get("title", "Replication of the literature's claims"),
                 st.get("description", ""), seeds, bases, claims,
                 None if k is None else float(k), tuple(sets))
