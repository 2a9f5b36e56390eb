"""Skan broker: routing core (pure) and the trio I/O layer around it."""
