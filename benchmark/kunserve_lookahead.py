"""``python -m benchmark.kunserve_lookahead``: the command's old name, kept working; the module is
``benchmark.kunserve.lookahead``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("benchmark.kunserve.lookahead", run_name="__main__", alter_sys=True)
