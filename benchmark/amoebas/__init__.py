"""AMOEBAs' benchmarks: the SIMULATED cluster that drives the transformation-aware scheduler's
policy against merge-on-demand baselines (``sim.py``, ``python -m benchmark.amoebas``), and the
costs of re-sharding the KV by head (``kv_cost.py``) and of releasing and gathering the FFN
weights in place (``weights_cost.py``), each against the AMOEBAs paper's base variant."""
