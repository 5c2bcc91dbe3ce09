"""Prefill/decode disaggregation: KV layouts and pairing, transfer engines, the prefill and decode sides."""
