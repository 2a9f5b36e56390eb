"""Sans-IO protocol codecs and state machines (no trio imports)."""
