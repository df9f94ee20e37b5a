"""Tier kinds and their typed configs: user dicts are parsed here, once.

Any process. Maps kind names (``cpu``, ``disk``, ``mooncake``, ``valkey``) to
config classes. Every kind's module is imported only when a config of that
kind is parsed, so importing this module never imports mooncake or redis.
``ConfigReader`` is the shared helper the config classes' ``from_dict`` use
to collect every problem of one dict into a single ``ValueError``.
"""

from __future__ import annotations

import enum
import importlib
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar, cast

from hybridkv.tiers.base import Tier

E = TypeVar("E", bound=enum.Enum)


class TierKind(enum.Enum):
    CPU = "cpu"
    DISK = "disk"
    MOONCAKE = "mooncake"
    VALKEY = "valkey"


_CONFIG_CLASSES: dict[TierKind, tuple[str, str]] = {
    TierKind.CPU: ("hybridkv.tiers.cpu", "CpuConfig"),
    TierKind.DISK: ("hybridkv.tiers.disk.config", "DiskConfig"),
    TierKind.MOONCAKE: ("hybridkv.tiers.mooncake.config", "MooncakeConfig"),
    TierKind.VALKEY: ("hybridkv.tiers.valkey.config", "ValkeyConfig"),
}


class TierConfig(Protocol):
    """What every ``<Kind>Config`` offers (frozen kw_only dataclasses)."""

    @property
    def load_weight(self) -> float: ...

    def build(self) -> Tier: ...


def _allowed_kinds() -> str:
    return ", ".join(kind.value for kind in TierKind)


def config_class(kind: TierKind) -> Any:
    """The config class of ``kind`` (imports its module on first use)."""
    module_name, class_name = _CONFIG_CLASSES[kind]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"tier kind {kind.value!r} is not available: importing {module_name} failed "
            f"({exc}); install its extra (pip install 'hybridkv[{kind.value}]') "
            f"or use one of: {_allowed_kinds()}"
        ) from exc
    return getattr(module, class_name)


def parse_tier_config(raw: Mapping[str, Any], *, where: str = "tier") -> TierConfig:
    """Parse one tier dict ``{"kind": ..., <that kind's keys>}`` into its typed config."""
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"{where}: expected a mapping with a 'kind' key, got {type(raw).__name__} {raw!r}"
        )
    kind_value = raw.get("kind")
    try:
        kind = TierKind(kind_value)
    except ValueError:
        raise ValueError(
            f"{where}: 'kind' is {kind_value!r}; allowed kinds: {_allowed_kinds()}; "
            f'fix: add e.g. "kind": "cpu"'
        ) from None
    rest = {key: value for key, value in raw.items() if key != "kind"}
    from_dict = config_class(kind).from_dict
    return cast(TierConfig, from_dict(rest, where=f"{where} (kind {kind.value})"))


def parse_tier_configs(
    raw: Sequence[Mapping[str, Any]], *, where: str = "tiers"
) -> list[TierConfig]:
    """Parse a list of tier dicts; problems of every entry go into one ValueError."""
    if isinstance(raw, str | bytes | Mapping) or not isinstance(raw, Sequence):
        raise TypeError(f"{where}: expected a list of tier mappings, got {type(raw).__name__}")
    if not raw:
        raise ValueError(f"{where}: empty list; give at least one tier, e.g. [{{'kind': 'cpu'}}]")
    configs: list[TierConfig] = []
    problems: list[str] = []
    for i, item in enumerate(raw):
        try:
            configs.append(parse_tier_config(item, where=f"{where}[{i}]"))
        except (ValueError, TypeError) as exc:
            problems.append(str(exc))
    if problems:
        raise ValueError("\n".join(problems))
    return configs


def build_tier(config: TierConfig) -> Tier:
    return config.build()


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


def value_problems(*, capacity_bytes: object, minimum: int, load_weight: object) -> list[str]:
    """Checks shared by the configs' ``__post_init__`` (code that skips ``from_dict``)."""
    problems = []
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        problems.append(f"capacity_bytes={capacity_bytes!r}: must be an int")
    elif capacity_bytes < minimum:
        problems.append(f"capacity_bytes={capacity_bytes}: must be >= {minimum}")
    weight_ok = isinstance(load_weight, int | float) and not isinstance(load_weight, bool)
    if not (weight_ok and 0 < load_weight < math.inf):  # type: ignore[operator]
        problems.append(f"load_weight={load_weight!r}: must be a finite number > 0")
    return problems


class ConfigReader:
    """Reads one raw config dict and collects every problem before raising.

    ``allowed`` maps each accepted key to a short description of its value;
    the final error lists them. Readers return a placeholder for a bad value,
    so call ``finish()`` before using any result.
    """

    def __init__(self, raw: Mapping[str, Any], *, where: str, allowed: Mapping[str, str]) -> None:
        if not isinstance(raw, Mapping):
            raise TypeError(f"{where}: expected a mapping, got {type(raw).__name__} {raw!r}")
        self._raw = raw
        self._where = where
        self._allowed = allowed
        self.problems: list[str] = [f"unknown key {key!r}" for key in raw if key not in allowed]

    def _problem(self, key: str, value: object, rule: str) -> None:
        self.problems.append(f"{key}={value!r}: {rule}")

    def byte_size(self, key: str, *, minimum: int = 1, default: int | None = None) -> int:
        if key not in self._raw:
            if default is None:
                self.problems.append(f"missing required key {key!r} ({self._allowed[key]})")
                return minimum
            return default
        value = self._raw[key]
        size = parse_byte_size(value)
        if size is None or size < minimum:
            rule = f'must be a byte count >= {minimum} (int, or "512MiB", "4GB")'
            self._problem(key, value, rule)
            return minimum
        return size

    def integer(self, key: str, *, default: int, minimum: int = 1) -> int:
        value = self._raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self._problem(key, value, f"must be an integer >= {minimum}")
            return default
        return value

    def positive_float(self, key: str, *, default: float) -> float:
        value = self._raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            self._problem(key, value, "must be a number > 0")
            return default
        if not math.isfinite(value) or value <= 0:
            self._problem(key, value, "must be a finite number > 0")
            return default
        return float(value)

    def text(self, key: str, *, default: str | None = None) -> str:
        if key not in self._raw:
            if default is None:
                self.problems.append(f"missing required key {key!r} ({self._allowed[key]})")
                return ""
            return default
        value = self._raw[key]
        if not isinstance(value, str) or not value:
            self._problem(key, value, "must be a non-empty string")
            return ""
        return value

    def optional_bool(self, key: str) -> bool | None:
        value = self._raw.get(key)
        if value is not None and not isinstance(value, bool):
            self._problem(key, value, "must be true, false or null")
            return None
        return value

    def choice(self, key: str, enum_type: type[E], *, default: E) -> E:
        value = self._raw.get(key, default.value)
        try:
            return enum_type(value)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in enum_type)
            self._problem(key, value, f"must be one of {allowed}")
            return default

    def finish(self) -> None:
        """Raise one ValueError naming every problem and the allowed keys."""
        if not self.problems:
            return
        allowed = "; ".join(f"{key} ({rule})" for key, rule in self._allowed.items())
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        raise ValueError(
            f"{self._where}: {len(self.problems)} problem(s):\n{lines}\n"
            f"  allowed keys: {allowed}\n  fix: correct or remove the keys listed above"
        )
