"""Benchmarks: throughput, trace replay, quality evaluation and their reports."""
