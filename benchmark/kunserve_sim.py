"""``python -m benchmark.kunserve_sim``: the command's old name, kept working; the module is
``benchmark.kunserve.sim``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.kunserve.sim", run_name="__main__", alter_sys=True)
