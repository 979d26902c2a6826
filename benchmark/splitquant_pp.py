"""``python -m benchmark.splitquant_pp``: the command's old name, kept working; the module is
``benchmark.splitquant.pp``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.splitquant.pp", run_name="__main__", alter_sys=True)
