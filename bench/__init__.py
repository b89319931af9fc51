"""Benchmarks (see docs/benchmarks.md); run as scripts: python bench/<name>.py --help."""
