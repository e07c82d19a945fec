"""Placeholder package: the ring_attention arrives with its own issue."""
