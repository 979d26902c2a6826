"""MorphServe: under KV pressure, swap the least important decoder layers to pre-quantized
W8/W4 variants in place, turn the freed weight memory into KV capacity, restore when the
pressure falls.

    control/     engine-agnostic controller: pressure signals in, typed swap actions out
    engines/     the per-layer precision variants: formats, build, manifest, startup plan
    executor/    applies actions to SGLang objects between batches (variants, KV resize)
    parallel/    morphing under tensor, pipeline and data parallelism
    config.py    the frozen ``MorphConfig`` and its flags
    http.py      ``/morph/*`` routes; messages.py their typed IPC; provenance.py per response
"""
