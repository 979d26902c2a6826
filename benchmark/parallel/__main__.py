"""``python -m benchmark.parallel``: per-step times and transitions of multi-rank servers
(``benchmark.parallel.timings``)."""

import runpy

runpy.run_module("benchmark.parallel.timings", run_name="__main__", alter_sys=True)
