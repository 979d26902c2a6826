"""Bursty-load trace replay (``python -m benchmark.replay``): trace -> open-loop client ->
per-configuration metrics -> JSON, Markdown and plots."""
