"""tuneplane.proto.message_speed: every generated message behaves exactly as betterproto itself
makes it behave, built, set, encoded, decoded and read, with and without the speedup."""

from __future__ import annotations

import inspect
import re
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import betterproto
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tuneplane.proto import message_speed, v1

ROOT = Path(__file__).resolve().parents[2]
MESSAGES = sorted(
    (c for _, c in inspect.getmembers(v1, inspect.isclass) if issubclass(c, betterproto.Message)),
    key=lambda c: c.__name__,
)
_INTS = {
    "int32": (-(2**31), 2**31 - 1), "sint32": (-(2**31), 2**31 - 1),
    "sfixed32": (-(2**31), 2**31 - 1), "uint32": (0, 2**32 - 1), "fixed32": (0, 2**32 - 1),
    "int64": (-(2**63), 2**63 - 1), "sint64": (-(2**63), 2**63 - 1),
    "sfixed64": (-(2**63), 2**63 - 1), "uint64": (0, 2**64 - 1), "fixed64": (0, 2**64 - 1),
}  # fmt: skip


def _meta(cls: type[betterproto.Message]) -> Any:
    return getattr(cls, "_betterproto")  # noqa: B009 - betterproto types its metadata loosely


def _scalar(kind: str, enum: Any) -> st.SearchStrategy[Any]:
    if kind in _INTS:
        return st.integers(*_INTS[kind])
    simple: dict[str, st.SearchStrategy[Any]] = {
        "string": st.text(max_size=6),
        "bytes": st.binary(max_size=6),
        "bool": st.booleans(),
        "double": st.floats(allow_nan=False),
        "float": st.floats(allow_nan=False, width=32),
    }
    if kind == "enum":
        return st.sampled_from(list(enum))
    return simple[kind]


def recipe(cls: type[betterproto.Message], depth: int = 0) -> st.SearchStrategy[Any]:
    """A message to build, as (class, {field: value or nested recipe}): built later, under
    whichever implementation is installed."""
    meta = _meta(cls)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for name, field in meta.meta_by_field_name.items():
        repeated = isinstance(meta.default_gen[name](), list)
        kind = field.proto_type
        if kind == "message":
            if depth >= 3:
                continue
            one = recipe(meta.cls_by_field[name], depth + 1)
        elif kind == "map":
            key_kind, value_kind = field.map_types
            value_cls = meta.cls_by_field.get(f"{name}.value")
            values = (
                recipe(value_cls, depth + 1)
                if value_kind == "message"
                else _scalar(value_kind, value_cls)
            )
            fields[name] = st.dictionaries(_scalar(key_kind, None), values, max_size=2)
            continue
        else:
            one = _scalar(kind, meta.cls_by_field.get(name))
        fields[name] = st.lists(one, max_size=2) if repeated else one
    groups: dict[str, list[str]] = {}
    for name, field in meta.meta_by_field_name.items():
        if field.group and not field.optional:
            groups.setdefault(field.group, []).append(name)

    @st.composite
    def build(draw: st.DrawFn) -> tuple[type[betterproto.Message], dict[str, Any]]:
        chosen = {g: draw(st.sampled_from([None, *names])) for g, names in groups.items()}
        in_group = {n for names in groups.values() for n in names}
        values = {}
        for name, strategy in fields.items():
            if name in in_group and name not in chosen.values():
                continue
            if draw(st.booleans()):
                values[name] = draw(strategy)
        return cls, values

    return build()


def make(plan: Any) -> Any:
    """The message (or list, dict, value) a recipe stands for, built now."""
    if isinstance(plan, tuple) and len(plan) == 2 and isinstance(plan[0], type):
        cls, values = plan
        return cls(**{name: make(value) for name, value in values.items()})
    if isinstance(plan, list):
        return [make(item) for item in plan]
    if isinstance(plan, dict):
        return {key: make(value) for key, value in plan.items()}
    return plan


def observe(message: betterproto.Message) -> list[Any]:
    """What code can see of a message: its bytes, its dict, what reading each field gives."""
    meta = _meta(type(message))
    seen: list[Any] = [bytes(message), message.to_dict(), betterproto.serialized_on_wire(message)]
    seen += [betterproto.which_one_of(message, group) for group in meta.oneof_field_by_group]
    for name in meta.meta_by_field_name:
        try:
            value = getattr(message, name)
        except AttributeError as exc:
            seen.append(("AttributeError", str(exc)))
            continue
        seen.append(repr(value))
        if isinstance(value, betterproto.Message):
            seen.append(betterproto.serialized_on_wire(value))
    seen.append(repr(message))
    return seen


def both(work: Callable[[], list[Any]]) -> tuple[list[Any], list[Any]]:
    """``work`` under betterproto's own methods, then under the speedup (left installed)."""
    message_speed.uninstall()
    try:
        plain = work()
    finally:
        assert message_speed.install()
    return plain, work()


@pytest.fixture(autouse=True)
def _installed_after() -> Iterator[None]:
    yield
    assert message_speed.install()


def test_the_speedup_is_installed_over_the_pinned_betterproto() -> None:
    assert message_speed.installed()
    assert getattr(betterproto, "__version__", None) == message_speed.WRITTEN_FOR
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = [p for p in pins if p.startswith("betterproto")]
    assert pinned == [f"betterproto[rust-codec]=={message_speed.WRITTEN_FOR}"], (
        "betterproto moved: check proto/message_speed.py against the new Message before "
        "changing WRITTEN_FOR"
    )


def test_no_generated_message_is_deprecated() -> None:
    """Defaults are made without catch_warnings, which only silenced deprecated messages."""
    generated = (ROOT / "proto" / "v1" / "__init__.py").read_text()
    assert not re.search(r"deprecat", generated, re.IGNORECASE)


def test_another_betterproto_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    message_speed.uninstall()
    original = betterproto.Message.__dict__["__getattribute__"]
    monkeypatch.setattr(betterproto, "__version__", "2.0.0b8")
    assert not message_speed.install()
    assert betterproto.Message.__dict__["__getattribute__"] is original
    assert not message_speed.installed()


@settings(max_examples=300)
@given(st.sampled_from(MESSAGES).flatmap(recipe))
def test_a_message_built_and_read_is_the_same(plan: Any) -> None:
    plain, fast = both(lambda: observe(make(plan)))
    assert fast == plain


@settings(max_examples=300)
@given(st.sampled_from(MESSAGES).flatmap(recipe))
def test_a_message_decoded_and_read_is_the_same(plan: Any) -> None:
    message_speed.uninstall()
    try:
        data = bytes(make(plan))
    finally:
        message_speed.install()
    cls = plan[0]
    plain, fast = both(lambda: observe(cls().parse(data)))
    assert fast == plain


@settings(max_examples=200)
@given(st.sampled_from([c for c in MESSAGES if _meta(c).oneof_field_by_group]).flatmap(
    lambda cls: st.tuples(recipe(cls), st.data())
))  # fmt: skip
def test_setting_a_oneof_member_clears_its_siblings_the_same(plan: Any) -> None:
    (cls, _), data = plan
    meta = _meta(cls)
    group = data.draw(st.sampled_from(sorted(meta.oneof_field_by_group)))
    member = data.draw(st.sampled_from(sorted(f.name for f in meta.oneof_field_by_group[group])))

    def work() -> list[Any]:
        message = make(plan[0])
        setattr(message, member, meta.default_gen[member]())
        return observe(message)

    plain, fast = both(work)
    assert fast == plain


def test_a_message_is_told_from_other_values_as_isinstance_tells() -> None:
    messages = [cls() for cls in vars(v1).values()
                if isinstance(cls, type) and issubclass(cls, betterproto.Message)]  # fmt: skip
    others: list[object] = [b"", "", 0, 0.5, [], {}, None, True, object(), betterproto.Message]
    assert len(messages) > 50
    for value in [*messages, *others]:
        assert message_speed._is_message(value) is isinstance(value, betterproto.Message), value
