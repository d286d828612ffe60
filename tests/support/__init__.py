"""Helpers the tests share (and the benchmarks that run the same checks on larger bundles):
never a benchmark imported by a test."""
