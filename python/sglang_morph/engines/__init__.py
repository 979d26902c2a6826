"""Layer engines: the per-layer precision variants (formats, manifest, offline builder).

Submodules are imported where used, so importing the package stays free of torch.
"""
