"""State that outlives a connection and the process: the durable event store (docs/store.md)."""

from broker.store.db import StoreError
from broker.store.store import Store, default_dir

__all__ = ["Store", "StoreError", "default_dir"]
