"""The unit of data every component shares: one prompt with its reference answer."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Example:
    prompt: str
    """The raw prompt text (before any chat template)."""
    answer: str
    """The reference answer, already extracted (`42`, `\\frac{1}{2}`), never empty."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Everything else the row carried (other fields, `source` = `file:line`); passed to rewards."""


class DataError(ValueError):
    """A malformed data row or file; the message is one line naming file:line (or row), the key
    and what was expected."""
