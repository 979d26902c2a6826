"""Placeholders for ops SGLang imports but never calls for the models we serve.

SGLang imports these names at module load on its CPU path, so they must exist;
calling one is a configuration error that should fail loudly and name the op.
"""

from __future__ import annotations

from typing import Callable, NoReturn


def not_implemented(op_name: str, reason: str) -> Callable[..., NoReturn]:
    message = f"sgl_kernel CPU (sglang-morph): {op_name} is not implemented; {reason}"

    def op(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(message)

    op.__name__ = op.__qualname__ = op_name
    op.__doc__ = f"Always raises NotImplementedError: {reason}"
    return op
