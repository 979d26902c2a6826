"""``python -m benchmark.morph_transition``: the command's old name, kept working; the module is
``benchmark.morph.transition``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.morph.transition", run_name="__main__", alter_sys=True)
