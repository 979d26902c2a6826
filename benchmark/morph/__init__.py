"""MorphServe's benchmarks: one transition, the per-step hook's cost, static precision maps'
quality and speed, and the layer order's tables."""
