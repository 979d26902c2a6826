"""``python -m benchmark.engines_quality``: the command's old name, kept working; the module is
``benchmark.morph.engines_quality``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.morph.engines_quality", run_name="__main__", alter_sys=True)
