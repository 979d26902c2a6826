"""sglang-morph: an elastic, workload-aware extension of SGLang, shipped as an SGLang plugin.

The package imports without SGLang or a GPU: SGLang-specific pieces live in modules that are
imported lazily by the plugin entry point (``sglang_morph.plugin:load``).
"""

__version__ = "0.1.0"

# The SGLang release every hook target and signature was checked against. Hooks patch private
# objects of SGLang, so any other release must be re-verified before it is allowed.
SGLANG_VERSION = "0.5.23"
