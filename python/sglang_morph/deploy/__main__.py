import sys

from sglang_morph.iserve.__main__ import main

sys.exit(main())
