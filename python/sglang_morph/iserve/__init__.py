"""iServe: intent-driven deployment from cheap fingerprints.

Data flows through the modules in this order:

- ``fingerprint``: the served model truncated to 1 and 2 decoder layers, with an engines
  directory restricted to those layers (the full model's W8/W4 variant files, hard-linked);
- ``space``: the configurations (bits x TP x PP), which of them SGLang and the plugin can
  serve here, and the ``scripts/serve.sh`` command of each;
- ``measure``: serving a fingerprint (or a full configuration) and reading its memory (accounted
  bytes from ``/morph/status``, the schedulers' RSS high-water marks) and latency;
- ``estimate``: M2 (memory) and L2 (latency) fitted to the fingerprints' measurements and
  extrapolated to the full depth;
- ``intents`` and ``placement``: rank the configurations for an intent, keep the first that is
  feasible and fits a device of the described cluster;
- ``__main__``: ``python -m sglang_morph.iserve``.
"""
