"""Checks of the errors bad input raises: one message naming every problem."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def assert_names_every_problem(
    info: pytest.ExceptionInfo[Exception], start: str, fragments: Iterable[str]
) -> None:
    """The message of the error ``info`` caught starts with ``start`` and holds each of
    ``fragments`` (a field, its value, the rule it broke)."""
    message = str(info.value)
    assert message.startswith(start), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
