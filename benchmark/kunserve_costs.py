"""``python -m benchmark.kunserve_costs``: the command's old name, kept working; the module is
``benchmark.kunserve.costs``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.kunserve.costs", run_name="__main__", alter_sys=True)
