"""Faster attribute access for betterproto messages: the same behaviour, without the exceptions.

betterproto 2.0.0b7 (the version TunePlane pins) overrides ``Message.__getattribute__`` and
``Message.__setattr__``. While a message is being built, each field set asks ``hasattr(self,
"_group_current")``, which raises and catches two ``AttributeError`` before ``__post_init__``
runs; every lazily made default enters ``warnings.catch_warnings()``. Profiled in a 5,000-Node
reconnect storm, that was most of the coordinator's time decoding a Hello: building one eight-GPU
Hello took about 0.8 ms, a Heartbeat about 0.2 ms (upstream: python-betterproto issue #631).

:func:`install` replaces the two methods, ``__post_init__`` and the default lookup with
equivalents that read the instance ``__dict__`` directly, so the per-field cost no longer
includes raising and catching:

- a field of a ``oneof`` other than the one set still raises ``AttributeError``;
- an unset field still gets its default, made once and kept (``PLACEHOLDER`` until read);
- a new message still starts with the ``oneof`` member its constructor set, and is on the wire
  when any field was given;
- setting a field still marks the message as on the wire, and setting a ``oneof`` member still
  clears its siblings;
- a default is made without ``catch_warnings``: that only silenced the ``DeprecationWarning`` of a
  deprecated message, and no message in ``tuneplane/v1`` is deprecated
  (``tests/proto/test_message_speed.py`` checks both, and compares every generated message's
  behaviour with and without this module).

It installs only over the exact betterproto version it was written against; under another it
leaves betterproto alone (and says so in the log), as the methods it replaces may have changed.
"""

from __future__ import annotations

import logging
from typing import Any

import betterproto
from betterproto import PLACEHOLDER, Message

log = logging.getLogger(__name__)

#: The betterproto release whose ``Message`` internals this module reproduces.
WRITTEN_FOR = "2.0.0b7"

_get = object.__getattribute__
_set = object.__setattr__
_ORIGINAL: dict[str, Any] = {}
# Per class: its betterproto metadata, and whether instances of a type are messages.
_META: dict[type, Any] = {}
_IS_MESSAGE: dict[type, bool] = {}


def _meta(message: Message) -> Any:
    cls: Any = type(message)  # betterproto types its per-class metadata too loosely for mypy
    meta = _META.get(cls)
    if meta is None:
        meta = _META[cls] = cls._betterproto
    return meta


def _is_message(value: object) -> bool:
    # Read off the type's MRO, not with isinstance: ``Message`` is an ABC, and an ABC's first
    # isinstance of a type that is not its subclass asks every registered and real subclass
    # (hundreds of generated messages, recursively). A forked collector paid that for every
    # new field type it set: a tenth of its CPU. No type is registered as a virtual Message.
    kind = type(value)
    answer = _IS_MESSAGE.get(kind)
    if answer is None:
        answer = _IS_MESSAGE[kind] = Message in kind.__mro__
    return answer


def _getattribute(self: Message, name: str) -> Any:
    group_current = _get(self, "__dict__").get("_group_current")
    if group_current is not None and name != "_betterproto" and name != "__class__":
        group = _meta(self).oneof_group_by_field.get(name)
        if group is not None and group_current[group] != name:
            raise AttributeError(
                f"{group!r} is set to {group_current[group]!r}, not {name!r}", name=name, obj=self
            )
    value = _get(self, name)
    if value is not PLACEHOLDER:
        return value
    value = _meta(self).default_gen[name]()
    _set(self, name, value)
    return value


def _setattr(self: Message, attr: str, value: Any) -> None:
    if _is_message(value) and not _meta(value).meta_by_field_name:
        value._serialized_on_wire = True
    fields = _get(self, "__dict__")
    if attr != "_serialized_on_wire":
        fields["_serialized_on_wire"] = True
    group_current = fields.get("_group_current")
    if group_current is not None:  # __post_init__ has run
        meta = _meta(self)
        group = meta.oneof_group_by_field.get(attr)
        if group is not None:
            for field in meta.oneof_field_by_group[group]:
                if field.name == attr:
                    group_current[group] = field.name
                else:
                    _set(self, field.name, PLACEHOLDER)
    _set(self, attr, value)


_FIELDS: dict[type, tuple[tuple[str, str | None, bool], ...]] = {}


def _post_init(self: Message) -> None:
    cls = type(self)
    fields = _FIELDS.get(cls)
    if fields is None:
        meta = _meta(self).meta_by_field_name
        fields = _FIELDS[cls] = tuple((n, m.group, m.optional) for n, m in meta.items())
    on_wire = False
    group_current: dict[str, str | None] = {}
    for name, group, optional in fields:
        if group:
            group_current.setdefault(group)
        value = _get(self, name)
        if value is not PLACEHOLDER and not (optional and value is None):
            on_wire = True
            if group:
                group_current[group] = name
    state = _get(self, "__dict__")
    state["_serialized_on_wire"] = on_wire
    state["_unknown_fields"] = b""
    state["_group_current"] = group_current


def _get_field_default(self: Message, field_name: str) -> Any:
    return _meta(self).default_gen[field_name]()


def installed() -> bool:
    """True when :func:`install` replaced betterproto's methods in this process."""
    return bool(_ORIGINAL)


def install() -> bool:
    """Replace the three methods (once); False, and betterproto untouched, under another
    betterproto version than :data:`WRITTEN_FOR`."""
    if _ORIGINAL:
        return True
    version = getattr(betterproto, "__version__", None)
    if version != WRITTEN_FOR:
        log.warning("betterproto speedup not installed: written for %s, found %s",
                    WRITTEN_FOR, version)  # fmt: skip
        return False
    for name, method in (
        ("__getattribute__", _getattribute),
        ("__setattr__", _setattr),
        ("__post_init__", _post_init),
        ("_get_field_default", _get_field_default),
    ):
        _ORIGINAL[name] = Message.__dict__[name]
        setattr(Message, name, method)
    return True


def uninstall() -> None:
    """Put betterproto's own methods back (for the test that compares the two)."""
    for name, method in _ORIGINAL.items():
        setattr(Message, name, method)
    _ORIGINAL.clear()
