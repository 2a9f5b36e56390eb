"""Routing-log records of issue 26's traffic, generated vectorised (numpy + pyarrow).

The shape measured on a real broker: 20 publishers (10 Skan, 10 HSP) over 50
groups, 8 subscribers (4 Skan, 4 HSP), 100-byte payloads, about 88,000
messages/s for 61 s (5.4 million records).  Group ``g`` has ``g % 9``
subscribers (0..8; the 6 groups with none make the undeliverable traffic),
the first four publishers authenticated as ``svc-a``/``svc-b``, the others
anonymous.

The same records are written in both formats of the routing log:

- JSON Lines exactly as the broker's ``RecordBuffer`` writes them (field
  order, spacing, ``"user":null``), in files of the writer's 64 MiB rotation;
- Parquet as the writer contract says (zstd, the record's columns and types),
  one file per 60 s of traffic (the writer's ``rotate_seconds``).

Both formats get the same file name stem ``routelog-<server>-<UTC stamp>-<counter>``.
:func:`expected` gives the totals the report must find, from the generator's
own arrays (not from reading the files back).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

PUBLISHERS = 20
GROUPS = 50
SUBSCRIBERS = 8
RATE = 88_000  # messages per second, as measured on the broker
SERVER = 1
START_US = 1_790_000_000_000_000  # 2026-09-21 ...
JSONL_ROTATE_BYTES = 64 << 20
PARQUET_ROTATE_SECONDS = 60
ROW_GROUP = 128 * 1024
CHUNK = 1 << 20  # records formatted per step (bounds memory)

# The writer contract's schema (see analytics/schema.py).
SCHEMA = pa.schema([
    ("time_us", pa.int64()), ("server", pa.int64()), ("lname", pa.string()),
    ("proto", pa.string()), ("user", pa.string()), ("group", pa.string()),
    ("instance", pa.string()), ("to", pa.string()), ("seq", pa.string()),
    ("size", pa.int64()), ("recipients", pa.map_(pa.string(), pa.int64())),
    ("delivered", pa.int64()), ("undeliverable", pa.bool_()),
])


def publishers() -> list[tuple[str, str, str | None]]:
    """(lname, protocol, user) of each publisher."""
    out = []
    for p in range(PUBLISHERS):
        proto = "skan" if p % 2 == 0 else "hsp"
        user = ("svc-a" if p < 2 else "svc-b") if p < 4 else None
        out.append((f"5f3a9c01_{p + 1}@bench-host", proto, user))
    return out


def group_names() -> list[str]:
    return [f"group-{g:02d}" for g in range(GROUPS)]


def recipients(g: int) -> dict[str, int]:
    """Copies per protocol for group ``g``: its ``g % 9`` subscribers, even ones Skan."""
    n = g % 9
    counts = {"hsp": n // 2, "skan": n - n // 2}
    return {k: v for k, v in sorted(counts.items()) if v}


def _name(opened_us: int, counter: int, suffix: str) -> str:
    secs, micros = divmod(opened_us, 1_000_000)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(secs))
    return f"routelog-{SERVER}-{stamp}.{micros:06d}Z-{counter:06d}{suffix}"


def _columns(start: int, stop: int, records: int, rng_seed: int = 7) -> dict[str, np.ndarray]:
    """Index columns of records [start, stop): time, publisher, group, seq."""
    i = np.arange(start, stop, dtype=np.int64)
    rng = np.random.default_rng(rng_seed + start)
    seconds = records / RATE
    return {
        "time_us": START_US + (i * int(seconds * 1e6)) // max(records, 1),
        "pub": i % PUBLISHERS,
        "group": rng.integers(0, GROUPS, size=len(i)),
        "seq": i // PUBLISHERS + 1,
    }


def _table(cols: dict[str, np.ndarray]) -> pa.Table:
    pubs = publishers()
    names = group_names()
    n = len(cols["pub"])
    pub, grp = pa.array(cols["pub"]), pa.array(cols["group"])
    seq = pc.cast(pa.array(cols["seq"]), pa.string())
    group = pc.take(pa.array(names), grp)
    # A Skan frame: 4-byte prefix, header with from/to/group/instance/seq, 100-byte payload.
    size = pc.add(pc.add(pc.utf8_length(seq).cast(pa.int64()),
                         pc.utf8_length(group).cast(pa.int64())), 140)
    rmaps = pa.array([list(recipients(g).items()) for g in range(GROUPS)],
                     type=pa.map_(pa.string(), pa.int64()))
    delivered_of = np.array([sum(recipients(g).values()) for g in range(GROUPS)], np.int64)
    delivered = delivered_of[cols["group"]]
    star = pa.array(["*"] * n)
    return pa.table({
        "time_us": pa.array(cols["time_us"]),
        "server": pa.array(np.full(n, SERVER, np.int64)),
        "lname": pc.take(pa.array([p[0] for p in pubs]), pub),
        "proto": pc.take(pa.array([p[1] for p in pubs]), pub),
        "user": pc.take(pa.array([p[2] for p in pubs], pa.string()), pub),
        "group": group,
        "instance": star,
        "to": star,
        "seq": seq,
        "size": size,
        "recipients": pc.take(rmaps, grp),
        "delivered": pa.array(delivered),
        "undeliverable": pa.array(delivered == 0),
    }, schema=SCHEMA)


def _json_lines(cols: dict[str, np.ndarray], table: pa.Table) -> pa.Array:
    """The broker's JSONL lines (RecordBuffer's exact text) for the records of ``table``."""
    pubs = publishers()
    names = group_names()
    prefixes = []
    for lname, proto, user in pubs:
        u = "null" if user is None else f'"{user}"'
        for g in names:
            prefixes.append(f',"server":{SERVER},"lname":"{lname}","proto":"{proto}",'
                            f'"user":{u},"group":"{g}","instance":"*","to":"*","seq":"')
    suffixes = []
    for g in range(GROUPS):
        r = recipients(g)
        d = sum(r.values())
        body = ",".join(f'"{k}":{v}' for k, v in r.items())
        suffixes.append(f',"recipients":{{{body}}},"delivered":{d},'
                        f'"undeliverable":{"false" if d else "true"}}}\n')
    key = pa.array(cols["pub"] * GROUPS + cols["group"])
    return pc.binary_join_element_wise(
        '{"time_us":', pc.cast(table["time_us"], pa.string()),
        pc.take(pa.array(prefixes), key), table["seq"], '","size":',
        pc.cast(table["size"], pa.string()),
        pc.take(pa.array(suffixes), pa.array(cols["group"])), "")


def generate(directory: str, records: int, *, jsonl: bool = True,
             parquet: bool = True) -> dict[str, int]:
    """Write ``records`` records to ``directory/jsonl`` and ``directory/parquet``.

    Returns {format: bytes written}.
    """
    written = {}
    if jsonl:
        os.makedirs(os.path.join(directory, "jsonl"), exist_ok=True)
    if parquet:
        os.makedirs(os.path.join(directory, "parquet"), exist_ok=True)
    jfile = None
    jcount = pcount = 0
    jbytes = 0
    pwriter: pq.ParquetWriter | None = None
    pwindow = -1
    written["jsonl"] = written["parquet"] = 0

    def close_parquet() -> None:
        nonlocal pwriter
        if pwriter is not None:
            pwriter.close()
            pwriter = None

    for start in range(0, records, CHUNK):
        stop = min(records, start + CHUNK)
        cols = _columns(start, stop, records)
        table = _table(cols)
        if parquet:
            # One file per PARQUET_ROTATE_SECONDS of traffic.
            window = (cols["time_us"] - START_US) // (PARQUET_ROTATE_SECONDS * 1_000_000)
            for w in np.unique(window):
                rows = np.nonzero(window == w)[0]
                if w != pwindow:
                    close_parquet()
                    pcount += 1
                    pwindow = int(w)
                    name = _name(int(cols["time_us"][rows[0]]), pcount, ".parquet")
                    pwriter = pq.ParquetWriter(os.path.join(directory, "parquet", name), SCHEMA,
                                               compression="zstd")
                assert pwriter is not None
                pwriter.write_table(table.slice(int(rows[0]), len(rows)),
                                    row_group_size=ROW_GROUP)
        if jsonl:
            lines = _json_lines(cols, table)
            data = pc.binary_join(pa.array([lines], pa.list_(pa.string())), "")[0].as_py()
            blob = data.encode()
            # Split at line ends into files of about JSONL_ROTATE_BYTES.
            pos = 0
            while pos < len(blob):
                if jfile is None or jbytes >= JSONL_ROTATE_BYTES:
                    if jfile is not None:
                        jfile.close()
                    jcount += 1
                    first = int(blob[pos + 11: blob.index(b",", pos)])
                    # Open across chunks (a file spans several): closed on rotation.
                    jfile = open(os.path.join(directory, "jsonl",  # noqa: SIM115
                                              _name(first, jcount, ".jsonl")), "wb")
                    jbytes = 0
                end = min(len(blob), pos + JSONL_ROTATE_BYTES - jbytes)
                if end < len(blob):
                    end = blob.index(b"\n", end - 1) + 1
                jfile.write(blob[pos:end])
                jbytes += end - pos
                written["jsonl"] += end - pos
                pos = end
    close_parquet()
    if jfile is not None:
        jfile.close()
    if parquet:
        pdir = os.path.join(directory, "parquet")
        written["parquet"] = sum(os.path.getsize(os.path.join(pdir, n)) for n in os.listdir(pdir))
    return written


def expected(records: int) -> dict[str, object]:
    """What a report over the generated records must say, from the generator's arrays."""
    messages = bytes_ = deliveries = undeliverable = 0
    per_group = np.zeros(GROUPS, np.int64)
    delivered_of = np.array([sum(recipients(g).values()) for g in range(GROUPS)], np.int64)
    for start in range(0, records, CHUNK):
        stop = min(records, start + CHUNK)
        cols = _columns(start, stop, records)
        table = _table(cols)
        messages += stop - start
        bytes_ += pc.sum(table["size"]).as_py()
        d = delivered_of[cols["group"]]
        deliveries += int(d.sum())
        undeliverable += int((d == 0).sum())
        per_group += np.bincount(cols["group"], minlength=GROUPS)
    return {
        "messages": messages, "bytes": bytes_, "deliveries": deliveries,
        "undeliverable": undeliverable, "groups": int((per_group > 0).sum()),
        "senders": min(PUBLISHERS, records),
        "per_group": dict(zip(group_names(), (int(x) for x in per_group), strict=True)),
    }
