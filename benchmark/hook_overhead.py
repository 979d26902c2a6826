"""``python -m benchmark.hook_overhead``: the command's old name, kept working; the module is
``benchmark.morph.hook_overhead``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.morph.hook_overhead", run_name="__main__", alter_sys=True)
