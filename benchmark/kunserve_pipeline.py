"""``python -m benchmark.kunserve_pipeline``: the command's old name, kept working; the module is
``benchmark.kunserve.pipeline``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.kunserve.pipeline", run_name="__main__", alter_sys=True)
