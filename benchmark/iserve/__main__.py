"""``python -m benchmark.iserve``: iServe's estimates against measured configurations
(``benchmark.iserve.estimates``)."""

import runpy

runpy.run_module("benchmark.iserve.estimates", run_name="__main__", alter_sys=True)
