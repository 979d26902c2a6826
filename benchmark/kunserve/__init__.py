"""KunServe's benchmarks: the chunk cost model, transfer bandwidth, the live pair's pipeline,
lookahead micro-batching and the SIMULATED clusters."""
