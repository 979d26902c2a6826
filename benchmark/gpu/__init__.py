"""GPU measurements (device machine only): kernels, transition cost, VMM KV growth, SGLang probe.

``benchmark/gpu/run_all.sh`` runs all of them in one call and writes JSON + Markdown results;
see benchmark/gpu/README.md.
"""
