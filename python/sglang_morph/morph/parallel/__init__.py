"""Morphing under SGLang's parallel layouts: ``tensor`` (each TP rank shards the variants at load
and swaps at the same step), ``pipeline`` (each stage morphs its own layers, also with stages
on several nodes), ``relay`` (TP rank 0's or stage 0's controller decides for every rank),
``replicas`` (each DP replica morphs on its own)."""
