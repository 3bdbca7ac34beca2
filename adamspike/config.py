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
import difflib
import math
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:   # python 3.8 - 3.10 (the 910B stack runs 3.8): the same parser as a package
    import tomli as tomllib


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
    if origin in (typing.Union, getattr(types, "UnionType", typing.Union)) and type(None) in args:
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


def cli_main(ap: Any, argv: list[str] | None, body: Any, prog: str,
             errors: tuple[type[BaseException], ...] = (ConfigError,)) -> int:
    """The one wrapper of a sub-command's `main`: parse argv with `ap` (--help: 0, a usage
    error: 2), then body(args); one of `errors` -> "prog: message" on stderr and 2."""
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    try:
        return body(args)
    except errors as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except TypeError:   # python < 3.10: `X | None` / `list[X]` annotations do not evaluate
        mod = sys.modules.get(cls.__module__)
        ns = dict(vars(mod)) if mod is not None else {}
        out: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            for k, v in getattr(klass, "__annotations__", {}).items():
                out[k] = _annotation(v, ns) if isinstance(v, str) else v
        return out


_GENERIC = {"list": typing.List, "tuple": typing.Tuple, "dict": typing.Dict}


def _split_top(s: str, sep: str) -> list[str]:
    """`s` split on `sep` outside brackets."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "["
        depth -= ch == "]"
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + [cur]


def _annotation(s: str, ns: dict) -> Any:
    """An annotation string in python >= 3.10 syntax (`int | None`, `list[str]`,
    `tuple[int, ...]`) as a typing object on older pythons."""
    s = s.strip()
    alts = _split_top(s, "|")
    if len(alts) > 1:
        return typing.Union[tuple(_annotation(a, ns) for a in alts)]
    m = re.fullmatch(r"([\w.]+)\[(.*)\]", s)
    if m:
        base = _GENERIC.get(m.group(1)) or eval(m.group(1), ns)  # noqa: S307 - own annotations
        args = tuple(... if a.strip() == "..." else _annotation(a, ns)
                     for a in _split_top(m.group(2), ","))
        return base[args if len(args) > 1 else args[0]]
    if s == "None":
        return type(None)
    return eval(s, ns)  # noqa: S307 - the project's own annotations


def from_dict(cls: type, data: typing.Mapping[str, Any], prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested mapping; unknown keys are errors."""
    if not isinstance(data, typing.Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or '<root>'}: expected a table, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    moved = getattr(cls, "MOVED_KEYS", {})   # old name -> its dotted key now
    for k in sorted(set(data) & set(moved)):
        raise ConfigError(f"{prefix}{k}: moved to {moved[k]} (rename the key)")
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
        key = resolve_key(cls, key, flat_paths)
        d = nested
        parts = key.split(".")
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = value
    return nested


def resolve_key(cls: type, key: str, flat_paths: list[str] | None = None,
                allowed: typing.Sequence[str] | None = None) -> str:
    """The dotted key `key` names: itself, or the one key whose last part it is (`eps` ->
    `optim.eps`, README "Configs"); `allowed` narrows the keys (e.g. predict's candidate
    keys). ConfigError for an unknown (with the closest known key) or ambiguous key."""
    flat_paths = list(allowed) if allowed is not None else (flat_paths or _leaf_paths(cls))
    key = key.strip().lstrip("-").replace("-", "_")
    if key in flat_paths:
        return key
    matches = [p for p in flat_paths if p.split(".")[-1] == key]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"--{key}: ambiguous, use one of {', '.join('--' + m for m in matches)}")
    _raise_moved(cls, key)
    close = difflib.get_close_matches(key, flat_paths + [p.split(".")[-1] for p in flat_paths],
                                      n=1)
    raise ConfigError(f"unknown config key: {key}" + (f" (did you mean {close[0]}?)" if close
                                                       else "")
                      + (f"; known: {', '.join(flat_paths)}" if allowed is not None else ""))


def parse_setting_text(cls: type, text: str, allowed: typing.Sequence[str] | None = None
                       ) -> dict[str, Any]:
    """`--setting` text, `optim.eps=1e-6,b2=0.95`, as {dotted key: number}: the one parser
    of settings on a command line (predict, assess); keys as resolve_key reads them."""
    flat: dict[str, Any] = {}
    for part in (x.strip() for x in text.split(",") if x.strip()):
        key, sep, val = part.partition("=")
        if not sep:
            raise ConfigError(f"--setting {text!r}: {part!r} is not KEY=VALUE")
        key = resolve_key(cls, key, allowed=allowed)
        v = val.strip()
        try:
            flat[key] = int(v) if v.lstrip("-").isdigit() else float(v)
        except ValueError:
            raise ConfigError(f"--setting {text!r}: {key}: not a number: {val!r}") from None
        if isinstance(flat[key], float) and not math.isfinite(flat[key]):
            raise ConfigError(f"--setting {text!r}: {key}: must be finite, got {val!r}")
    if not flat:
        raise ConfigError(f"--setting {text!r}: no KEY=VALUE")
    return flat


def _raise_moved(cls: type, key: str) -> None:
    """ConfigError "moved to ..." if `key` is a section's MOVED_KEYS entry."""
    *path, leaf = key.split(".")
    for p in path:
        hints = _hints(cls)
        if p not in hints or not dataclasses.is_dataclass(hints[p]):
            return
        cls = hints[p]
    moved = getattr(cls, "MOVED_KEYS", {})
    if leaf in moved:
        raise ConfigError(f"{key}: moved to {moved[leaf]} (rename the key)")


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


def nest(data: typing.Mapping[str, Any]) -> dict[str, Any]:
    """{"optim.eps": 1e-6, "train": {"seed": 1}} -> {"optim": {"eps": 1e-6}, "train": {"seed": 1}}:
    dotted keys (and nested tables) to one nested dict; a key given twice is an error."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(f"config key: expected a non-empty string, got {key!r}")
        if isinstance(value, typing.Mapping):
            value = nest(value)
        d, parts = out, key.split(".")
        for i, p in enumerate(parts[:-1]):
            d = d.setdefault(p, {})
            if not isinstance(d, dict):
                raise ConfigError(f"{'.'.join(parts[:i + 1])}: is a value, not a section")
        leaf = parts[-1]
        if leaf in d:
            both = isinstance(d[leaf], dict) and isinstance(value, dict)
            twice = sorted(set(flatten(d[leaf])) & set(flatten(value))) if both else [""]
            if twice:
                raise ConfigError(f"{'.'.join(filter(None, (*parts, twice[0])))}: given twice")
            value = merge(d[leaf], value)
        d[leaf] = value
    return out


def flatten(data: typing.Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """The inverse of `nest`: a nested dict to {dotted key: value}."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        if isinstance(v, typing.Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_set(text: str) -> tuple[str, Any]:
    """One `--set KEY=VALUE`: the dotted KEY and VALUE read as a TOML value (3, 1e-4,
    [1, 2], "text", {a = 1}); ConfigError naming it otherwise."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE")
    try:
        return key, tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--set {text!r}: the value is not a TOML value ({e})") from None


def apply_sets(data: typing.Mapping[str, Any], sets: typing.Sequence[str],
               sections: typing.Collection[str]) -> dict[str, Any]:
    """A config file's tables with `--set SECTION.KEY=VALUE` applied, each replacing one
    (dotted) key of one of `sections`, in order: how a caller (the study's size table,
    configs/study.toml) gives a file's experiment explicit sizes. The sections it touches
    come back as nested tables (the file's own shape); ConfigError names a bad one."""
    out = dict(data)
    for text in sets:
        key, value = parse_set(text)
        sec, _, rest = key.partition(".")
        if sec not in sections or not rest:
            raise ConfigError(f"--set {text!r}: expected SECTION.KEY with SECTION one of "
                              f"{', '.join(sorted(sections))}")
        table = out.get(sec, {})
        if not isinstance(table, typing.Mapping):
            raise ConfigError(f"--set {text!r}: {sec} is not a table")
        flat = flatten(table)
        for k in [k for k in flat if k.startswith(rest + ".")]:
            del flat[k]                          # a table replaced by the value as a whole
        flat[rest] = value
        out[sec] = nest(flat)
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
    except UnicodeDecodeError as e:   # TOML is UTF-8 text
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: 0x{e.object[e.start]:02x}); "
                          "a TOML config must be UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None


def load_config(cls: type, path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Any:
    """Schema defaults <- `base` dict <- TOML file <- CLI overrides, then validated."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        data = merge(data, read_toml(path))
    if overrides:
        data = merge(data, parse_overrides(cls, overrides))
    return from_dict(cls, data)


def replace(obj: Any, changes: typing.Mapping[str, Any] | None = None, /, **kw: Any) -> Any:
    """A copy of config `obj` with dotted-key changes ({"optim.eps": 1e-6}, or keywords with
    "__" for ".") applied and the whole re-validated; errors name the key."""
    over = {**(changes or {}), **{k.replace("__", "."): v for k, v in kw.items()}}
    return from_dict(type(obj), merge(to_dict(obj), nest(over)))
