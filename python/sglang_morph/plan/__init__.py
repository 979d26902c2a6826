"""``python -m sglang_morph.plan``: SplitQuant's command under its old name, kept working; the
package is ``sglang_morph.splitquant``."""
