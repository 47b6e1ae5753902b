"""Filters: each drops the candidates a request must not go to. One plugin per module."""
