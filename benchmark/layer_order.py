"""``python -m benchmark.layer_order``: the command's old name, kept working; the module is
``benchmark.morph.layer_order``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.morph.layer_order", run_name="__main__", alter_sys=True)
