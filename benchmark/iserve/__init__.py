"""iServe's benchmarks: estimates against measured configurations (``python -m
benchmark.iserve``, the same as ``benchmark.iserve.estimates``), launch noise, the SIMULATED
cluster, and the measurement grid (``grid.sh``)."""
