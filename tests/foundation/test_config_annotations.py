"""adamspike.config on python < 3.10: the annotation fallback (`X | None`, `list[X]`,
`tuple[X, ...]` strings evaluated without typing.get_type_hints) gives the types
get_type_hints gives on this python, for every config dataclass of the project."""

import dataclasses
import sys
import typing

import pytest

from adamspike import config as C
from adamspike.train_config import RunConfig
from fullscale.launch import ClusterConfig


def _same(a, b) -> bool:
    if a == b:
        return True
    oa, ob = typing.get_origin(a), typing.get_origin(b)
    union = (typing.Union, getattr(__import__("types"), "UnionType", typing.Union))
    if oa in union and ob in union:
        return set(typing.get_args(a)) == set(typing.get_args(b))
    return oa == ob and all(_same(x, y) for x, y in zip(typing.get_args(a), typing.get_args(b)))


def _dataclasses(root):
    seen, todo = [], [root]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        for tp in typing.get_type_hints(cls).values():
            if dataclasses.is_dataclass(tp) and tp not in seen:
                todo.append(tp)
    return seen


@pytest.mark.parametrize("root", [RunConfig, ClusterConfig])
def test_fallback_matches_get_type_hints(root):
    for cls in _dataclasses(root):
        ns = dict(vars(sys.modules[cls.__module__]))
        want = typing.get_type_hints(cls)
        for name, ann in cls.__annotations__.items():
            got = C._annotation(ann, ns) if isinstance(ann, str) else ann
            assert _same(got, want[name]), (cls.__name__, name, ann, got, want[name])


def test_annotation_strings_of_newer_syntax():
    ns = {"int": int, "str": str, "float": float}
    assert C._annotation("int | None", ns) == typing.Optional[int]
    assert C._annotation("list[str]", ns) == typing.List[str]
    assert C._annotation("tuple[int, ...]", ns) == typing.Tuple[int, ...]
    assert C._annotation("dict[str, list[float]] | None", ns) == typing.Optional[typing.Dict[str, typing.List[float]]]
    assert C._is_optional(C._annotation("float | None", ns)) == (True, float)


def test_hints_fall_back_when_get_type_hints_cannot(monkeypatch):
    def fail(cls):
        raise TypeError("unsupported operand type(s) for |: 'type' and 'NoneType'")
    monkeypatch.setattr(C.typing, "get_type_hints", fail)
    from adamspike.train_config import ModelSection
    h = C._hints(ModelSection)
    assert C._is_optional(h["rope_theta"]) == (True, float)
