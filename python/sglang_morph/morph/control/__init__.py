"""Engine-agnostic control plane: pressure signals in, typed morph actions out.

Pure Python on plain dataclasses (no SGLang, no torch), so the same code runs behind the
scheduler hook, in unit tests and in a cluster simulator:

    PressureSnapshot -> PressureMonitor.observe -> PressureSignals
                                                   -> MorphController.decide -> SwapLayers | None
"""

from sglang_morph.morph.control.controller import LayerCosts, MorphController, SwapLayers
from sglang_morph.morph.control.policy import MODES, ModePolicy, get_mode
from sglang_morph.morph.control.signals import PressureMonitor, PressureSignals, PressureSnapshot

__all__ = [
    "LayerCosts",
    "MODES",
    "ModePolicy",
    "MorphController",
    "PressureMonitor",
    "PressureSignals",
    "PressureSnapshot",
    "SwapLayers",
    "get_mode",
]
