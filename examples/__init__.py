"""Runnable examples; see README.md."""
