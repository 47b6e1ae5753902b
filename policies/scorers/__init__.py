"""Scorers: each gives every candidate a score in [0, 1], higher is better. One plugin per module."""
