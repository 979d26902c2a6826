"""``torch.ops.sgl_kernel.murmur_hash32_cpu``: per-(row, column) hashes for seeded sampling.

SGLang's ``multinomial_with_seed`` (used when a request sets
``sampling_seed``) turns these hashes into Gumbel noise. It calls the op
through ``torch.ops`` inside ``torch.compile``, so it is registered in the
``sgl_kernel`` op namespace together with a fake (shape-only) implementation.

The hash of ``(seed, position, column)`` is standard MurmurHash3_x86_32 with
seed 0 over the 16-byte little-endian key ``seed (u64) | position (u32) |
column (u32)``, matching SGLang's Triton kernel bit for bit. All arithmetic
runs in int64 on values below 2**32 so nothing overflows.
"""

from __future__ import annotations

import torch

from sgl_kernel._checks import require_ndim, require_tensor

_MASK_32 = 0xFFFFFFFF
_KEY_BYTES = 16
_C1 = 0xCC9E2D51
_C2 = 0x1B873593
_FMIX_1 = 0x85EBCA6B
_FMIX_2 = 0xC2B2AE35


def _mul_mod_2_32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``0 <= x < 2**32``.

    The constant is split into 16-bit halves so no int64 product overflows.
    """
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK_32


def _rotl_32(x: torch.Tensor, bits: int) -> torch.Tensor:
    return ((x << bits) | (x >> (32 - bits))) & _MASK_32


def _scramble(block: torch.Tensor) -> torch.Tensor:
    """Per-block key scramble; independent of the running hash, so it can be hoisted."""
    return _mul_mod_2_32(_rotl_32(_mul_mod_2_32(block, _C1), 15), _C2)


def _absorb(state: torch.Tensor, scrambled_block: torch.Tensor) -> torch.Tensor:
    state = _rotl_32(state ^ scrambled_block, 13)
    return (state * 5 + 0xE6546B64) & _MASK_32


def _finalize(state: torch.Tensor) -> torch.Tensor:
    state = state ^ _KEY_BYTES
    state = state ^ (state >> 16)
    state = _mul_mod_2_32(state, _FMIX_1)
    state = state ^ (state >> 13)
    state = _mul_mod_2_32(state, _FMIX_2)
    return state ^ (state >> 16)


def _int64_bits(values: torch.Tensor) -> torch.Tensor:
    """Two's-complement bits of integer ``values`` widened to int64."""
    if values.dtype == torch.uint64:
        # Reinterpret instead of converting: seeds >= 2**63 must keep their bits.
        return values.view(torch.int64)
    return values.to(torch.int64)


# Kept alive for the process lifetime: dropping it would deregister the op.
_LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")
_LIBRARY.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")


def murmur_hash32_cpu(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    """Hash every (row, column) pair: returns uint32 ``(n, m)``.

    ``seed`` and ``positions`` are 1-D of length ``n`` (any integer dtype;
    positions are truncated to 32 bits), ``col_indices`` is 1-D of length
    ``m``. Entry ``[r, c]`` hashes ``(seed[r], positions[r], col_indices[c])``.
    """
    for name, tensor in (("seed", seed), ("positions", positions), ("col_indices", col_indices)):
        require_tensor(name, tensor)
        require_ndim(name, tensor, 1)
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise ValueError(f"{name} must have an integer dtype, got {tensor.dtype}")
    if seed.shape != positions.shape:
        raise ValueError(
            f"seed and positions must have the same shape, got {tuple(seed.shape)} "
            f"and {tuple(positions.shape)}"
        )
    seed_bits = _int64_bits(seed)
    seed_low = seed_bits & _MASK_32
    seed_high = (seed_bits >> 32) & _MASK_32
    state = torch.zeros_like(seed_low)
    state = _absorb(state, _scramble(seed_low))
    state = _absorb(state, _scramble(seed_high))
    state = _absorb(state, _scramble(_int64_bits(positions) & _MASK_32))
    column_blocks = _scramble(_int64_bits(col_indices) & _MASK_32)
    state = _absorb(state[:, None], column_blocks[None, :])
    return _finalize(state).to(torch.uint32)


# A plain dispatcher kernel rather than torch.library.custom_op, whose first
# call imports torch._dynamo (~2 s per scheduler process).
_LIBRARY.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")


@torch.library.register_fake("sgl_kernel::murmur_hash32_cpu", lib=_LIBRARY)
def _murmur_hash32_cpu_fake(
    seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor
) -> torch.Tensor:
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)
