"""``python -m benchmark.iserve_sim``: the command's old name, kept working; the module is
``benchmark.iserve.sim``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.iserve.sim", run_name="__main__", alter_sys=True)
