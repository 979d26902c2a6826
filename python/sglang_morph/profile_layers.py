"""``python -m sglang_morph.profile_layers``: the command's old name, kept working; the module is
``sglang_morph.morph.profile_layers``."""

import sys

from sglang_morph.morph.profile_layers import main

if __name__ == "__main__":
    sys.exit(main())
