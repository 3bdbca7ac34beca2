"""Typed TOML configs with `--section.key value` overrides.

A config schema is a dataclass whose fields are scalars or nested dataclasses (sections).
Each scalar field may carry validation metadata made with :func:`param`:

    lr: float = param(3e-4, lo=0.0, lo_open=True, help="peak learning rate")

`load_config(Schema, path, overrides)` reads TOML, applies overrides, and validates. Every
problem raises :class:`ConfigError` naming the offending key: unknown keys, wrong types,
values out of range, non-finite floats. The resolved config round-trips through
`to_dict` / `from_dict` (what run.json stores).
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config value or key is wrong; the message names the key."""


def param(default: Any, *, lo: float | None = None, hi: float | None = None,
          lo_open: bool = False, hi_open: bool = False, choices: tuple | None = None,
          help: str = "") -> Any:
    """A dataclass field with a range (closed unless *_open) or a set of choices."""
    meta = dict(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, choices=choices, help=help)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _origin_args(tp: Any) -> tuple[Any, tuple]:
    return typing.get_origin(tp), typing.get_args(tp)


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin, args = _origin_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return True, rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    return False, tp


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Convert `value` (from TOML or a CLI string) to type `tp`, or raise ConfigError."""
    optional, tp = _is_optional(tp)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{key}: a value is required (got none)")
    origin, args = _origin_args(tp)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else str
        out = [_coerce(f"{key}[{i}]", inner, v) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple else out
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
            if f.is_integer():
                return int(f)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if not math.isfinite(f):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return f
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")


def _check_range(key: str, value: Any, meta: typing.Mapping) -> None:
    if value is None:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: must be one of {list(choices)}, got {value!r}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value < lo or (meta.get("lo_open") and value == lo)):
        op = ">" if meta.get("lo_open") else ">="
        raise ConfigError(f"{key}: must be {op} {lo}, got {value!r}")
    if hi is not None and (value > hi or (meta.get("hi_open") and value == hi)):
        op = "<" if meta.get("hi_open") else "<="
        raise ConfigError(f"{key}: must be {op} {hi}, got {value!r}")


def check_value(key: str, value: Any, tp: Any = float, *, strict: bool = False,
                **limits: Any) -> Any:
    """Validate one value outside a schema by the same rules as a config field: the type
    (`tp`, e.g. float, int, `int | None`), finiteness, and `param`'s limits (lo, hi,
    lo_open, hi_open, choices). strict=True refuses strings for numbers (values read from
    JSON files, where "0.9" is a mistake). Returns the coerced value; raises ConfigError
    naming `key`."""
    if strict and isinstance(value, str) and _is_optional(tp)[1] in (int, float):
        raise ConfigError(f"{key}: expected a number, got the string {value!r}")
    value = _coerce(key, tp, value)
    _check_range(key, value, limits)
    return value


def check_finite_args(namespace: Any) -> None:
    """argparse: every float option must be finite (argparse's `type=float` takes "nan" and
    "inf"); ConfigError naming the option (`--loss-scale: must be finite, got nan`)."""
    for name, value in vars(namespace).items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"--{name.replace('_', '-')}: must be finite, got {value}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: typing.Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested mapping; unknown keys are errors."""
    if not isinstance(data, typing.Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a table, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''}: "
                          + ", ".join(prefix + k for k in unknown)
                          + f" (known in {prefix.rstrip('.') or 'top level'}: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        key = prefix + name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = from_dict(tp, data.get(name, {}), key + ".")
        elif name in data:
            value = _coerce(key, tp, data[name])
            _check_range(key, value, f.metadata)
            kwargs[name] = value
    obj = cls(**kwargs)
    validate(obj, prefix)
    return obj


def validate(obj: Any, prefix: str = "") -> None:
    """Re-check ranges of defaults and run `__post_init__`-style `check()` hooks."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            continue
        _check_range(prefix + f.name, value, f.metadata)
    check = getattr(obj, "check", None)
    if callable(check):
        try:
            check()
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}" if prefix and not str(e).startswith(prefix) else str(e)) from None


def to_dict(obj: Any) -> dict[str, Any]:
    """Nested plain dict (lists for tuples) suitable for JSON / TOML."""
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, tuple):
            out[f.name] = list(v)
        else:
            out[f.name] = v
    return out


def parse_overrides(cls: type, overrides: list[str]) -> dict[str, Any]:
    """`["--optim.eps", "1e-8", "--train.seed=3"]` -> nested dict of raw strings.

    Keys may omit the section when the field name is unique across sections
    (`--eps 1e-8`). Unknown or ambiguous keys raise ConfigError.
    """
    flat_paths = _leaf_paths(cls)
    nested: dict[str, Any] = {}
    i = 0
    while i < len(overrides):
        tok = overrides[i]
        if not tok.startswith("--"):
            raise ConfigError(f"expected --key value, got {tok!r}")
        tok = tok[2:]
        if "=" in tok:
            key, value = tok.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"--{tok}: missing value")
            key, value = tok, overrides[i + 1]
            i += 2
        key = key.replace("-", "_")
        if key not in flat_paths:
            matches = [p for p in flat_paths if p.split(".")[-1] == key]
            if len(matches) == 1:
                key = matches[0]
            elif len(matches) > 1:
                raise ConfigError(f"--{key}: ambiguous, use one of {', '.join('--' + m for m in matches)}")
            else:
                raise ConfigError(f"unknown config key: {key}")
        d = nested
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return nested


def _leaf_paths(cls: type, prefix: str = "") -> list[str]:
    hints = _hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _leaf_paths(tp, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Any:
    """Schema defaults <- `base` dict <- TOML file <- CLI overrides, then validated."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = _merge(data, read_toml(path))
    if overrides:
        data = _merge(data, parse_overrides(cls, overrides))
    return from_dict(cls, data)


def replace(obj: Any, **changes: Any) -> Any:
    """`dataclasses.replace` with dotted keys for nested sections, re-validated."""
    data = to_dict(obj)
    for key, value in changes.items():
        d = data
        parts = key.replace("__", ".").split(".")
        for p in parts[:-1]:
            d = d[p]
        d[parts[-1]] = value
    return from_dict(type(obj), data)
