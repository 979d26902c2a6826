"""Portable pure-torch ``sgl_kernel`` for SGLang's CPU engine (sglang-morph).

SGLang started with ``SGLANG_USE_CPU_ENGINE=1`` imports ``sgl_kernel`` in its
scheduler subprocesses before any plugin code runs, and the PyPI
``sglang-kernel`` wheel is a CUDA build that cannot load without libcuda. This
package provides the names that CPU path imports, implemented in torch.

It deliberately registers no Intel-AMX op: SGLang probes
``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` to pick its AMX
backend, and must fall back to its plain torch implementations instead. The
only registered torch op is ``sgl_kernel::murmur_hash32_cpu`` (seeded
sampling), which SGLang calls unconditionally on CPU.

See README.md for every op and its status.
"""

__version__ = "0.1.0"

from sgl_kernel import mamba, speculative
from sgl_kernel.hashing import murmur_hash32_cpu
from sgl_kernel.kv_cache import copy_all_layer_kv_cache_cpu
from sgl_kernel.speculative import (
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    reconstruct_indices_from_tree_mask,
    rotate_input_ids_cpu,
    verify_tree_greedy_cpu,
)

__all__ = [
    "__version__",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "mamba",
    "murmur_hash32_cpu",
    "reconstruct_indices_from_tree_mask",
    "rotate_input_ids_cpu",
    "speculative",
    "verify_tree_greedy_cpu",
]
