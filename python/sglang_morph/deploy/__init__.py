"""``python -m sglang_morph.deploy``: iServe's command under its old name, kept working; the
package is ``sglang_morph.iserve``."""
