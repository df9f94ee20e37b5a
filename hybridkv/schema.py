"""Declared configuration: one mechanism to parse, check and document what users write.

Any process; imports pydantic only. Every user-facing configuration (the
connector's extra config, each tier kind, a model-groups file) is a frozen,
``kw_only`` pydantic dataclass using ``CONFIG``: unknown keys are refused and
each field declares its type, bounds, default and a one-line description.
``parse`` turns raw input into such an object; bad input raises one
``ConfigError`` that lists every problem with where it is, the value given
and what is allowed. Objects that code builds (a model's groups, key
namespaces, transfer settings) declare their fields the same way and call
``check_fields``, so a value made in code meets the same declarations as one
read from a file. ``field_docs`` describes the fields, for ``hybridkv
config`` and the tables of docs/CONFIGURATION.md, so docs and code cannot drift.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, NamedTuple, cast, get_args, get_origin

import typing_extensions
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
)
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

PositiveInt = Annotated[StrictInt, Field(gt=0)]
"""An int > 0; never a bool, a float or a string (unlike pydantic's own)."""

NonNegativeInt = Annotated[StrictInt, Field(ge=0)]

NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]

Seconds = Annotated[Number, Field(gt=0, allow_inf_nan=False)]
"""A duration: a positive, finite number of seconds."""


def _distinct(items: Sequence[object]) -> Sequence[object]:
    repeated = [item for item, count in Counter(items).items() if count > 1]
    if repeated:
        raise ValueError(f"has duplicates {repeated}: give each once")
    return items


Distinct = AfterValidator(_distinct)
"""``Annotated[tuple[X, ...], Distinct]``: no item twice."""


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


_SHOULD = re.compile(r"^(?:Input|String|Tuple|List|Dictionary) should")


def _problem(kind: Any, error: Mapping[str, Any]) -> str:
    path, owner, field_name = _resolve(kind, tuple(error["loc"]))
    kind_of_error = error["type"]
    secret = owner is not None and field_name is not None and _is_secret(owner, field_name)
    shown = "<hidden>" if secret else _short(error.get("input"))
    message = str(error["msg"]).removeprefix("Value error, ")
    message = _SHOULD.sub("must", message).replace(" after validation", "")
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


# --- objects built in code ----------------------------------------------------------


class Problems:
    """What is wrong with one object built in code, raised as one ``ConfigError``.

    ``check_fields`` fills it from the field types; the object then adds the
    rules across fields that no type can state, asking ``valid`` first so that
    a rule never reads a value its type already refused.
    """

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.lines: list[str] = []
        self.invalid_fields: set[str] = set()

    def valid(self, *names: str) -> bool:
        """Whether the fields ``names`` hold values of their declared types."""
        return self.invalid_fields.isdisjoint(names)

    def add(self, lines: Iterable[str]) -> None:
        self.lines.extend(lines)

    def raise_if_any(self) -> None:
        if self.lines:
            raise ConfigError(f"invalid {self.owner}: " + "; ".join(self.lines))


def check_fields(obj: object) -> Problems:
    """The problems of ``obj``'s fields (its class's public annotations) by their types.

    Strict, unlike ``parse``: no JSON conversions (a kind's name for its enum, a
    list for a tuple), since code passes the typed values themselves. Each line
    reads ``field=value: what is allowed``.
    """
    owner: Any = type(obj)
    adapter, names = _fields_adapter(owner)
    problems = Problems(owner.__name__)
    try:
        adapter.validate_python({name: getattr(obj, name) for name in names}, strict=True)
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            problems.invalid_fields.add(str(error["loc"][0]))
            problems.lines.append(_problem(owner, error))
    return problems


@functools.cache
def _fields_adapter(owner: type) -> tuple[TypeAdapter[Any], tuple[str, ...]]:
    hints = typing.get_type_hints(owner, include_extras=True)
    fields = {
        name: tp
        for name, tp in hints.items()
        if not name.startswith("_") and tp is not ClassVar and get_origin(tp) is not ClassVar
    }
    # A TypedDict of the fields: validating it builds no object, so a dataclass's
    # own __post_init__ is not run again (typing_extensions': pydantic's need on 3.11).
    typed_dict = cast(Any, typing_extensions.TypedDict)(f"{owner.__name__}Fields", fields)
    return TypeAdapter(typed_dict), tuple(fields)


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
