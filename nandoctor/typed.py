"""Typed values for recipe fields: one function turns what a recipe file or a `--set KEY=VALUE` holds into
the type the dataclass field declares, read from its annotation (not from its default, which may be None).

Both read YAML through `load_yaml`, YAML 1.2's core schema where PyYAML speaks YAML 1.1: only true and false
are booleans (`off`, `no`, `on`, `yes` stay strings: `gradient_checkpointing: off`, `compile: [off]`), and
`1e-8` is a number, not a string.

`AsWritten` is the base of the dataclasses read back from JSON that any version of nandoctor wrote (the
device facts, a run's meta): they give the same dict back, unknown and missing keys included.

Foundation module: imports only errors (and yaml).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml

from .errors import NandoctorError

BOOL_TAG = "tag:yaml.org,2002:bool"


# libyaml's parser where PyYAML was built with it (as knowledge.SafeLoader)
class CoreLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """yaml.SafeLoader with YAML 1.2 core booleans and exponent floats."""


CoreLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
CoreLoader.add_implicit_resolver(BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
CoreLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)

# the words a boolean field also takes, as before YAML 1.2 (and `--set flag=1`)
TRUE_WORDS = ("true", "yes", "on", "1")
FALSE_WORDS = ("false", "no", "off", "0")
NULL_WORDS = ("", "null", "none", "~")  # what a `--set` of an optional field means by "no value"


def load_yaml(text: str):
    """Parse YAML text with the core schema (CoreLoader); raises yaml.YAMLError."""
    return yaml.load(text, Loader=CoreLoader)


def field_types(cls) -> dict:
    """{field name: its annotation, resolved} of a dataclass."""
    return typing.get_type_hints(cls)


def _optional(hint) -> tuple[object, bool]:
    """(the type without None, whether None is allowed) of `X | None` or plain X."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(args)
    return hint, False


def describe(hint) -> str:
    """A type in words, for an error: 'a number', 'a list of 2 numbers', 'a string or null'."""
    kind, optional = _optional(hint)
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}
    if typing.get_origin(kind) is tuple or kind is tuple:
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            text = f"a list of {describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
        elif args:
            text = f"a list of {len(args)} {describe(args[0]).removeprefix('a ').removeprefix('an ')}s"
        else:
            text = "a list"
    else:
        text = words.get(kind, getattr(kind, "__name__", str(kind)))
    return f"{text} or null" if optional else text


def typed_value(key: str, value, hint, text: bool = False):
    """`value` as the type `hint` declares for the field `key`; raises one NandoctorError naming the key and
    the type. value is data read from YAML (a recipe file, run.json) or, with text=True, the string of a
    `--set KEY=VALUE`, which is read as YAML first: `0.9,0.95` and `[0.9, 0.95]` both give a tuple of
    floats to a tuple field, a string field takes the text as written, and an empty, null or none value
    gives None to an optional field."""
    if text:
        value = _from_text(key, value, hint)
    kind, optional = _optional(hint)
    if value is None and (optional or kind is dict):
        return None if optional else {}
    try:
        return _typed(value, kind)
    except (TypeError, ValueError):
        raise NandoctorError(f"{key} must be {describe(hint)}, got {value!r}") from None


def _from_text(key: str, text: str, hint):
    kind, optional = _optional(hint)
    if optional and text.strip().lower() in NULL_WORDS:
        return None
    if kind is str:
        return text
    if (typing.get_origin(kind) is tuple or kind is tuple) and not text.lstrip().startswith("["):
        text = f"[{text}]"  # a comma-separated list: q_proj,v_proj or 0.9,0.95
    try:
        return load_yaml(text)
    except yaml.YAMLError as e:
        raise NandoctorError(f"{key}: {text!r} is not valid YAML ({getattr(e, 'problem', e)})") from None


def _typed(value, kind):
    """value as `kind`, or TypeError / ValueError."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        word = str(value).lower() if isinstance(value, (str, int)) else None
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise TypeError
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError
        return float(value)  # a str: a YAML 1.1 reader (PyYAML's default) left 1e-8 as text
    if kind is str or kind is dict:
        if not isinstance(value, kind):
            raise TypeError
        return value
    if typing.get_origin(kind) is tuple or kind is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError
        args = typing.get_args(kind)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_typed(v, args[0]) for v in value)
        if args:
            if len(value) != len(args):
                raise ValueError
            return tuple(_typed(v, a) for v, a in zip(value, args))
        return tuple(value)
    return value


@dataclass(frozen=True)
class AsWritten:
    """The base of a dataclass that is read from JSON another nandoctor version may have written and is
    written back unchanged, so that a run stays readable both ways. Every field of a subclass has a
    default, the value a reader gets where the JSON lacked the key.

    read_keys: the keys the JSON had, in its order (None: every field, for one built in code); unknown:
    the keys this version has no field for, as read. `written()` gives exactly those keys back."""

    read_keys: tuple[str, ...] | None = field(default=None, kw_only=True, repr=False)
    unknown: dict = field(default_factory=dict, kw_only=True, repr=False)

    @classmethod
    def fields_read(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("read_keys", "unknown"))

    @classmethod
    def read(cls, data: dict, typed: dict[str, Callable] | None = None):
        """An instance from JSON data: each key with a field takes its value through typed[key] (a
        nested dataclass's reader) or as it is; the others go to `unknown`."""
        typed, names = typed or {}, cls.fields_read()
        return cls(
            **{k: typed[k](v) if k in typed else v for k, v in data.items() if k in names},
            read_keys=tuple(data),
            unknown={k: v for k, v in data.items() if k not in names},
        )

    def written(self, plain: dict[str, Callable] | None = None) -> dict:
        """The JSON data: the keys it was read with, in their order, each field's value through plain[key]
        (a nested dataclass's writer) or as it is, the unknown keys as read."""
        plain = plain or {}
        out = {}
        for k in self.read_keys if self.read_keys is not None else self.fields_read():
            if k in self.unknown:
                out[k] = self.unknown[k]
            else:
                out[k] = plain[k](getattr(self, k)) if k in plain else getattr(self, k)
        return out

    def has(self, key: str) -> bool:
        """Whether the JSON had `key` (a fact an older version did not record is not a difference)."""
        return key in (self.read_keys if self.read_keys is not None else self.fields_read())
