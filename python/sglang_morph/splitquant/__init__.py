"""SplitQuant (offline): per-layer bit-widths and pipeline stages for heterogeneous devices;
``python -m sglang_morph.splitquant`` (also ``python -m sglang_morph.plan``)."""
