"""Benchmarks behind ``tierstore bench``: each prints ratios measured in one run, never bare figures."""
