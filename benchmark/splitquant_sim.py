"""``python -m benchmark.splitquant_sim``: the command's old name, kept working; the module is
``benchmark.splitquant.sim``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.splitquant.sim", run_name="__main__", alter_sys=True)
