"""Multi-rank SGLang's benchmarks: per-step times and layer transitions under TP, PP and DP
(``python -m benchmark.parallel``, the same as ``benchmark.parallel.timings``)."""
