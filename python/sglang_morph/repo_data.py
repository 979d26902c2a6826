"""The small data files this repository ships in ``data/`` (provenance and licences:
``data/SOURCES.md``, ``data/LICENSES.md``).

One place names them, so the offline CLIs (calibration text), the benchmarks (perplexity text,
arrival traces) and the tests read the same files. The paths resolve inside the checkout the
package is installed from (``scripts/setup.sh`` installs it in editable mode).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DATA_DIR = REPO_ROOT / "data"
TEXT_DIR = DATA_DIR / "text"
TRACES_DIR = DATA_DIR / "traces"

# WikiText-2 raw test split: perplexity only, never calibration.
WIKITEXT2_TEST = TEXT_DIR / "wikitext2_test.txt"
# The first 1,000,000 bytes of the WikiText-2 raw train split: calibration (AWQ, the layer
# profile) and benchmark prompts.
WIKITEXT2_TRAIN_HEAD = TEXT_DIR / "wikitext2_train_head.txt"
