import sys

from sglang_morph.splitquant.__main__ import main

sys.exit(main())
