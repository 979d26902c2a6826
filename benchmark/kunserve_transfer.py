"""``python -m benchmark.kunserve_transfer``: the command's old name, kept working; the module is
``benchmark.kunserve.transfer``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.kunserve.transfer", run_name="__main__", alter_sys=True)
