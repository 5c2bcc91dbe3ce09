"""The serving benchmark client (`python -m tokenloom.bench_serving`): datasets, per-backend request functions,
metrics, the result block and JSON line, and plots."""
