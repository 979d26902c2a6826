"""Configuration primitives every mechanism shares: precision names and byte sizes.

Mechanism configurations (``morph.config``, ``kunserve.live.config``) are frozen dataclasses
parsed once at the CLI edge; what they have in common lives here so that every byte-size flag
(``--morph-memory-budget``, ``--morph-stage-budgets``) accepts the same syntax.
"""

from __future__ import annotations

import re

FULL_PRECISION_BITS = 16
# Bit-widths a layer can be served at; which ones exist for a model is the engines manifest's say.
KNOWN_BITS = (16, 8, 4)
_BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def is_int(value: object) -> bool:
    """An integer given as one (a JSON or CLI value), not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


class ConfigError(ValueError):
    """A flag is malformed or inconsistent; the message names the flag."""


def parse_bytes(text: str, flag: str, error: type[ConfigError] = ConfigError) -> int:
    """``'1073741824'``, ``'1GiB'``, ``'800MB'`` -> bytes; ``error`` naming ``flag`` otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _BYTE_UNITS:
        raise error(
            f"{flag}: cannot parse {text!r}; expected bytes like 1073741824, 800MB or 1.5GiB"
        )
    value = int(float(m.group(1)) * _BYTE_UNITS[unit])
    if value <= 0:
        raise error(f"{flag}: must be positive, got {text!r}")
    return value
