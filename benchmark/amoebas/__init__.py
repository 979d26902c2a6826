"""AMOEBAs' benchmarks: the costs of re-sharding the KV by head (``kv_cost.py``) and of
releasing and gathering the FFN weights in place (``weights_cost.py``), each against the
AMOEBAs paper's base variant."""
