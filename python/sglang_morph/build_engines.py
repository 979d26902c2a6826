"""``python -m sglang_morph.build_engines``: the command's old name, kept working; the module is
``sglang_morph.morph.build_engines``."""

import sys

from sglang_morph.morph.build_engines import main

if __name__ == "__main__":
    sys.exit(main())
