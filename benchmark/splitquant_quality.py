"""``python -m benchmark.splitquant_quality``: the command's old name, kept working; the module is
``benchmark.splitquant.quality``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.splitquant.quality", run_name="__main__", alter_sys=True)
