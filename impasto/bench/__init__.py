"""Benchmark clients (`impasto bench ...`)."""
