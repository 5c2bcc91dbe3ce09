"""Benchmarks that compare tokenloom against its peers; results go to docs/benchmarks.md."""
