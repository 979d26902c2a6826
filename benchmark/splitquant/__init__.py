"""SplitQuant's benchmarks: quality indicators, PP 2 plans served by SGLang and the SIMULATED
heterogeneous clusters."""
