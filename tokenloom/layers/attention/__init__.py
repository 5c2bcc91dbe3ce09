"""Attention backends behind one interface (see base.py)."""
