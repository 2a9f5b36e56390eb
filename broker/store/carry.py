"""Bridge spool and resume operations of failed commits, kept for the next commit.

A failed commit (disk full, I/O error) loses the persistence of its routed
messages (they stay "not persisted", BROKER-SPEC section 10), but the
bridges' spool inserts and deletes and the Mariner resume points were
acknowledged to nobody: the bridges rely on them surviving a restart.  The
writer keeps them here and applies them, in their order, before the next
commit's own (every operation is idempotent: INSERT OR IGNORE, DELETE,
INSERT OR REPLACE).

Bounded: an insert and a delete of the same message that both wait here
cancel out (the row never reached the disk), so during a long failure the
carry holds about what the bridges' buffers hold; beyond
:data:`MAX_CARRY_BYTES` of frames or :data:`MAX_CARRY_DELETES` deletes the
oldest go first and are counted as lost.  Used by the writer thread only
(under the store's lock).
"""

from __future__ import annotations

import attrs

# Frame bytes of spool inserts kept across failed commits: the same bound as
# the writer's queue (broker/store/writer.py MAX_PENDING_BYTES), so a stalled
# disk takes at most twice that memory.
MAX_CARRY_BYTES = 64 * 1024 * 1024
# Spool deletes kept across failed commits (about 100 bytes of memory each,
# so at most about 10 MB): a lost delete only re-sends an acknowledged
# message after a restart (at-least-once allows it).
MAX_CARRY_DELETES = 100_000

# (bridge, session, instance, ts, frame) / (bridge, session, instance) /
# bridge -> (bridge, server, session, instance): the writer's statement arguments.
SpoolAdd = tuple[str, int, int, float, bytes]
SpoolDel = tuple[str, int, int]
Resume = tuple[str, int, int, int]


@attrs.define
class SpoolCarry:
    max_bytes: int = MAX_CARRY_BYTES
    max_deletes: int = MAX_CARRY_DELETES
    adds: list[SpoolAdd] = attrs.field(factory=list)
    deletes: list[SpoolDel] = attrs.field(factory=list)
    resume: dict[str, Resume] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return len(self.adds) + len(self.deletes) + len(self.resume)

    def take(self, adds: list[SpoolAdd], deletes: list[SpoolDel], resume: dict[str, Resume]
             ) -> tuple[list[SpoolAdd], list[SpoolDel], dict[str, Resume]]:
        """The carried operations followed by a commit's own (and the carry emptied)."""
        if not self:
            return adds, deletes, resume
        merged = (self.adds + adds, self.deletes + deletes, {**self.resume, **resume})
        self.adds, self.deletes, self.resume = [], [], {}
        return merged

    def keep(self, adds: list[SpoolAdd], deletes: list[SpoolDel], resume: dict[str, Resume]
             ) -> int:
        """Keep a failed commit's operations (as :meth:`take` gave them); returns how
        many the bounds dropped (the oldest)."""
        gone = {d for d in deletes}
        added = {a[:3] for a in adds}
        self.adds = [a for a in adds if a[:3] not in gone]
        self.deletes = [d for d in deletes if d not in added]
        self.resume = resume
        lost = 0
        nbytes = sum(len(a[4]) for a in self.adds)
        drop = 0
        while nbytes > self.max_bytes:
            nbytes -= len(self.adds[drop][4])
            drop += 1
        if drop:
            del self.adds[:drop]
            lost += drop
        excess = len(self.deletes) - self.max_deletes
        if excess > 0:
            del self.deletes[:excess]
            lost += excess
        return lost
