"""Scheduling: requests, batches, admission policy, event loops."""
