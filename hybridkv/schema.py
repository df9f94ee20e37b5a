"""Declared configuration: one mechanism to parse, check and document what users write.

Any process; imports pydantic only. Every user-facing configuration (the
connector's extra config, each tier kind, a layout file) is a frozen,
``kw_only`` pydantic dataclass using ``CONFIG``: unknown keys are refused and
each field declares its type, bounds, default and a one-line description.
``parse`` turns raw input into such an object; bad input raises one
``ConfigError`` that lists every problem with where it is, the value given
and what is allowed. ``field_docs`` describes the fields, for ``hybridkv
config`` and the README tables, so docs and code cannot drift.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, NamedTuple, get_args, get_origin

from pydantic import BeforeValidator, ConfigDict, JsonValue, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=False)
"""The pydantic settings of every configuration dataclass."""

SECRET: dict[str, JsonValue] = {"secret": True}
"""``Field(json_schema_extra=SECRET)``: the value is never shown in errors."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_byte_size(value: object) -> int | None:
    """An int, or a string such as "512MiB", "4 GB", "1.5GiB"; None if unreadable."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return None
    match = _SIZE.match(value)
    if match is None:
        return None
    number, unit = match.group(1), (match.group(2) or "b").lower()
    power = "bkmgt".index(unit[0])
    scale = (1024 if "i" in unit else 1000) ** power
    return int(number) * scale if number.isdigit() else int(float(number) * scale)


def _byte_size(value: object) -> object:
    size = parse_byte_size(value)
    if size is None:
        raise ValueError('must be a byte count: an int, or a string such as "512MiB" or "4GB"')
    return size


def _path(value: object) -> object:
    if isinstance(value, Path):
        value = str(value)
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty path string")
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    path = Path(value).expanduser()
    if ".." in path.parts:
        raise ValueError("must not contain '..' segments: give the directory itself")
    return path


UserPath = Annotated[Path, BeforeValidator(_path)]
"""A file system path; ``~`` is expanded."""

ByteSize = Annotated[int, BeforeValidator(_byte_size)]
"""A size in bytes: an int or a string such as ``"4GiB"`` (binary) or ``"4GB"`` (decimal)."""


def _number(value: object) -> object:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("must be a number")
    return float(value)


Number = Annotated[float, BeforeValidator(_number)]
"""A float given as a JSON number (int or float; never a bool or a string)."""


class ConfigError(ValueError):
    """Bad configuration; the message lists every problem."""


def parse(kind: Any, raw: object, *, where: str) -> Any:
    """``raw`` validated into ``kind`` (a config dataclass or a type built of them)."""
    try:
        return _adapter(kind).validate_python(raw)
    except ValidationError as exc:
        raise ConfigError(format_errors(kind, exc, where=where)) from None


@functools.lru_cache(maxsize=64)
def _adapter(kind: Any) -> TypeAdapter[Any]:
    return TypeAdapter(kind)


# --- error messages ----------------------------------------------------------------


def format_errors(kind: Any, exc: ValidationError, *, where: str) -> str:
    lines = [_problem(kind, error) for error in exc.errors(include_url=False)]
    unique = list(dict.fromkeys(lines))
    head = f"{where}: {len(unique)} problem{'s' if len(unique) > 1 else ''}:"
    return "\n".join([head, *(f"  - {line}" for line in unique)])


def _problem(kind: Any, error: Mapping[str, Any]) -> str:
    path, owner, field_name = _resolve(kind, tuple(error["loc"]))
    kind_of_error = error["type"]
    secret = owner is not None and field_name is not None and _is_secret(owner, field_name)
    shown = "<hidden>" if secret else _short(error.get("input"))
    message = str(error["msg"]).removeprefix("Value error, ").replace("Input should be", "must be")
    if kind_of_error in ("unexpected_keyword_argument", "extra_forbidden"):
        allowed = ", ".join(_field_names(owner)) if owner is not None else "?"
        return f"{path}: unknown key; allowed keys: {allowed}"
    if kind_of_error in ("missing", "missing_keyword_argument"):
        described = ""
        if owner is not None and field_name is not None:
            described = f" ({_description(owner, field_name)})"
        return f"{path}: required key is missing{described}"
    if kind_of_error == "union_tag_invalid":
        tags = error.get("ctx", {}).get("expected_tags", "")
        return f"{path}.kind={_short(error['input'].get('kind'))}: must be one of {tags}"
    if kind_of_error == "union_tag_not_found":
        return f"{path or 'tier'}: needs a 'kind' key ({_tags_of(kind, error)})"
    if field_name is None and isinstance(error.get("input"), Mapping):  # a whole object's check
        return f"{path}: {message}" if path else message
    return f"{path}={shown}: {message}"


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tags_of(kind: Any, error: Mapping[str, Any]) -> str:
    tags = list(_union_members(_unwrap(_walk(kind, tuple(error["loc"]))[3])))
    return "one of " + ", ".join(repr(t) for t in tags) if tags else "see hybridkv config"


def _resolve(kind: Any, loc: tuple[Any, ...]) -> tuple[str, Any, str | None]:
    path, owner, field_name, _ = _walk(kind, loc)
    return path, owner, field_name


def _walk(kind: Any, loc: tuple[Any, ...]) -> tuple[str, Any, str | None, Any]:
    """The printable path of ``loc``, the dataclass holding its last field, that field,
    and the type ``loc`` points at.

    Walks the declared types alongside ``loc``: list indices, union tags (the
    discriminated tier kinds) and field names.
    """
    path = ""
    current: Any = kind
    owner: Any = None
    field_name: str | None = None
    for part in loc:
        current = _unwrap(current)
        members = _union_members(current)
        if members and isinstance(part, str) and part in members:
            current = members[part]  # a discriminator tag: not part of the path
            continue
        if isinstance(part, int):
            path += f"[{part}]"
            current = _item_type(current)
            owner, field_name = None, None
            continue
        if dataclasses.is_dataclass(current):
            owner, field_name = current, str(part)
            hints = typing.get_type_hints(current, include_extras=True)
            current = hints.get(str(part), Any)
        path += f".{part}" if path else str(part)
    return path, owner, field_name, current


def _unwrap(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _union_members(tp: Any) -> dict[str, Any]:
    if get_origin(tp) not in (typing.Union, types.UnionType):
        return {}
    out: dict[str, Any] = {}
    for member in get_args(tp):
        member = _unwrap(member)
        if dataclasses.is_dataclass(member):
            tag = getattr(member, "kind", None)
            if isinstance(tag, str):
                out[tag] = member
    return out


def _item_type(tp: Any) -> Any:
    args = get_args(_unwrap(tp))
    if get_origin(_unwrap(tp)) in (list, tuple, Sequence) and args:
        return args[0]
    for arg in args:  # X | None
        if get_origin(_unwrap(arg)) in (list, tuple, Sequence):
            return _item_type(arg)
    return Any


def _field_info(owner: Any, name: str) -> FieldInfo | None:
    fields = getattr(owner, "__pydantic_fields__", {})
    info = fields.get(name)
    return info if isinstance(info, FieldInfo) else None


def _is_secret(owner: Any, name: str) -> bool:
    info = _field_info(owner, name)
    extra = info.json_schema_extra if info is not None else None
    return isinstance(extra, dict) and bool(extra.get("secret"))


def _description(owner: Any, name: str) -> str:
    info = _field_info(owner, name)
    return (info.description or "") if info is not None else ""


def _field_names(owner: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(owner) if f.init]


# --- documentation -------------------------------------------------------------------


class FieldDoc(NamedTuple):
    name: str
    type_text: str
    default_text: str
    description: str


def field_docs(owner: Any) -> list[FieldDoc]:
    """One row per user-settable field of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(owner, include_extras=True)
    docs = []
    for f in dataclasses.fields(owner):
        if not f.init or f.name == "kind":
            continue
        docs.append(
            FieldDoc(
                f.name, _type_text(hints[f.name]), _default_text(f), _description(owner, f.name)
            )
        )
    return docs


def _default_text(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    if isinstance(value, FieldInfo):
        value = value.default
    if value is None:
        return "null"
    if isinstance(value, enum.Enum):
        return repr(value.value)
    if isinstance(value, bool | Path):
        return str(value).lower() if isinstance(value, bool) else str(value)
    return repr(value)


def _type_text(tp: Any) -> str:
    metadata = get_args(tp)[1:] if get_origin(tp) is Annotated else ()
    if any(isinstance(m, BeforeValidator) and m.func is _byte_size for m in metadata):
        return "bytes"
    if any(isinstance(m, BeforeValidator) and m.func is _number for m in metadata):
        return "number"
    tp = _unwrap(tp)
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        texts = [_type_text(a) for a in args if a is not type(None)]
        return " or ".join(dict.fromkeys(texts))
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if origin in (list, tuple, Sequence):
        return "list"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " or ".join(repr(m.value) for m in tp)
    if tp is Path:
        return "path"
    return getattr(tp, "__name__", str(tp))
