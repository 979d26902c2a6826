"""Morphing under SGLang's parallel layouts: ``tensor`` (each TP rank shards the variants at load
and swaps at the same step), ``pipeline`` (each stage morphs its own layers, also with stages
on several nodes), ``relay`` (TP rank 0's or stage 0's controller decides for every rank).

Data parallelism needs no module of its own: each replica is a scheduler process with its own
weights, KV pool, ``MorphRuntime``, budget (``--morph-memory-budget`` is per replica) and
controller. Nothing is shared, so nothing needs to agree: a replica that swaps grows only its
own pool, and SGLang's data-parallel controller sees the bigger pool in that replica's load
reports and sends it more. A ``/morph/swap`` names its ``replica``; the others answer
``SKIPPED`` (``elastic/control.py``) and change nothing, so a swap is one replica's
transaction.
"""
