"""Trio client libraries and command-line tools for the Skan broker."""
