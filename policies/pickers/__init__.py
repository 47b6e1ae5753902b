"""Pickers: each chooses one candidate from the weighted totals. One plugin per module."""
