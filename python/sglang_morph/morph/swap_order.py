"""The order in which decoder layers are swapped to a quantized variant: first entry first.

It comes from the Layer Importance Score profile (``python -m sglang_morph.morph.profile_layers``, whose
JSON holds it under ``"order"``); without a profile, layers go front to back.
"""

from __future__ import annotations

import json
from pathlib import Path


def front_to_back(num_layers: int) -> tuple[int, ...]:
    return tuple(range(num_layers))


def check_swap_order(order: object, num_layers: int) -> tuple[int, ...]:
    """``order`` as a tuple when it is a permutation of ``0..num_layers-1``, else ValueError."""
    if not isinstance(order, (list, tuple)):
        raise ValueError(f"swap order must be a list of layer indices, got {type(order).__name__}")
    # bool is an int subclass; JSON true/false in an order is a mistake, not layer 1/0.
    bad = [x for x in order if not isinstance(x, int) or isinstance(x, bool)]
    if bad:
        raise ValueError(f"swap order entries must be integers, got {bad[:5]!r}")
    if len(order) != num_layers:
        raise ValueError(f"swap order has {len(order)} entries, the model has {num_layers} layers")
    out_of_range = sorted({x for x in order if not 0 <= x < num_layers})
    if out_of_range:
        raise ValueError(f"swap order has layers {out_of_range} outside 0..{num_layers - 1}")
    missing = sorted(set(range(num_layers)) - set(order))
    if missing:
        raise ValueError(f"swap order is not a permutation: layers {missing} are missing "
                         "(so others repeat)")
    return tuple(order)


def load_swap_order(path: Path, num_layers: int) -> tuple[int, ...]:
    """The ``"order"`` of a profile JSON, checked to be a permutation of ``0..num_layers-1``.

    Raises FileNotFoundError for a missing file and ValueError, naming the file, for anything else.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"swap order file {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict) or "order" not in raw:
        raise ValueError(f"{path} has no \"order\" list; write it with "
                         "python -m sglang_morph.morph.profile_layers")
    try:
        return check_swap_order(raw["order"], num_layers)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
