"""Offline simulator: python -m dyncp.sim replays length distributions through the policies."""
