"""Multi-rank SGLang on CPU: tensor, pipeline and data parallelism and several nodes.

SGLang does the parallel work itself (sharded layers, gloo collectives, pipeline sends, the
data-parallel controller, multi-node launch); this package removes what stops it on a CPU.
Its hooks (``hooks.HOOKS``) are registered by the plugin in every scheduler process, with or
without ``--enable-morph``, and act on CPU only:

- ``cpu``: process groups without GPU communicators; one pinned thread count per rank.
- ``tied_head``: the last pipeline stage of a Llama with tied embeddings gets its own head.
- ``binding``: the default ``SGLANG_CPU_OMP_THREADS_BIND`` for a launch (``scripts/serve.sh``
  sets it when the user did not).

Morphing under these layouts (``--enable-morph`` with TP, PP or DP) lives in
``sglang_morph.morph.parallel``.
"""
