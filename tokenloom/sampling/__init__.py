"""Sampling parameters and their per-batch tensor form."""
