"""A no-op live mechanism built only on the elastic core's contract: the proof that a
mechanism is a folder plus one registration line (here the out-of-tree one,
``SGLANG_MORPH_EXTRA_MECHANISMS=toy_mechanism.mechanism``)."""
