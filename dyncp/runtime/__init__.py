"""Placeholder package: the runtime arrives with its own issue."""
