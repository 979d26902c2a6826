"""``python -m benchmark.iserve_noise``: the command's old name, kept working; the module is
``benchmark.iserve.noise``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.iserve.noise", run_name="__main__", alter_sys=True)
