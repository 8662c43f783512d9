"""Benchmarks behind `l2l bench`; each returns a JSON-able report."""
