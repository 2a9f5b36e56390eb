"""Bytes per Hat event with and without the ``payload-json`` tag (docs/eventer.md).

    python -m bench.payload_bytes

For representative Hat payloads, the Skan send frame an Eventer
registration becomes (what Skan subscribers receive, what crosses NATS),
the store's bytes per event (the row the store's ``RunBuilder`` makes: an
event with a source timestamp is a run of its own; its frame plus the packed
timestamp, delivery and offset arrays; SQLite's page and index overhead not
counted), and
the HatEventer.Event and Mariner event encodings Hat clients receive, each
with the tag as the broker now sends it and with the Skan view alone (what
the broker sent before issue 24).  Pure computation through the broker's
own functions; no broker process.
"""

from __future__ import annotations

from broker.core import events
from broker.core.inject import build_send
from broker.core.router import Routed
from broker.protocols.eventer.mapping import fast_encode_routed
from broker.protocols.mariner.mapping import EncodedEvents
from broker.store.batch_rows import RunBuilder
from wire.hat import JsonPayload, Timestamp
from wire.skan.eventjson import PAYLOAD_JSON_TAG, exact_text
from wire.skan.jsonvalue import json_to_skan

LNAME = b"6745e9a1_1a2b3c4d5e6f7a8b9c0d1e2f@plant-host"
PAYLOADS = {
    "enable true": True,
    "number 1234": 1234,
    "float 21.5": 21.5,
    "write command": {"request_id": "w-17", "value": 1234},
    "gateway data": {"value": 21.5, "quality": "GOOD", "timestamp": 1700000000.25},
    "hat-gui session": {"created": 1700000000.123456, "user": "operator",
                        "roles": ["admin"], "active": True},
    "text (no tag)": "pump running",
    "strings only (no tag)": {"state": "on", "mode": "auto"},
}
RUN = 1000


def frames(value: object, tagged: bool) -> list[Routed]:
    out = []
    for i in range(RUN):
        if tagged:
            message = events.send_for_event(("gateway", "modbus", "dev1", "data"),
                                            JsonPayload(value), sender=LNAME, seq=i + 1,
                                            source_timestamp=Timestamp(1700000000, 250000))
        else:
            message = build_send(LNAME, b"gateway", b"modbus/dev1/data", i + 1,
                                 json_to_skan(value),
                                 {events.SOURCE_TIMESTAMP_TAG: b"1700000000.250000"})
        out.append(Routed(message.frame, message.header, None, (), 1, 1795780740876513,
                          i + 1, 1700000001.5 + i * 1e-6))
    return out


def sizes(batch: list[Routed]) -> tuple[int, float, int, int]:
    frame = len(batch[0].frame)
    stored = 0.0
    # Source-timestamped messages are runs of one (their timestamp is indexed):
    # the row per event, as the writer builds it.
    for routed in batch[:50]:
        row = RunBuilder(routed.session, routed.instance, b"gateway", b"modbus/dev1/data",
                         1700000000250000, routed.timestamp, 1, routed.frame).row()
        stored += sum(len(row[i]) for i in (9, 10, 11, 12))
    eventer = len(fast_encode_routed(batch[0], 1))
    mariner = len(EncodedEvents(1)(batch[0]).encode())
    return frame, stored / 50, eventer, mariner


def main() -> None:
    print("| payload | Skan frame (wire, NATS) before -> now | store bytes/event before -> now "
          "| Eventer event before -> now | Mariner event before -> now "
          "| the tag's bytes if always carried |")
    print("|---|---|---|---|---|---|")
    for name, value in PAYLOADS.items():
        before = sizes(frames(value, tagged=False))
        now = sizes(frames(value, tagged=True))
        cells = [f"{b:.0f} -> {n:.0f} ({n - b:+.0f})" for b, n in zip(before, now, strict=True)]
        # tag length byte + "payload-json" + DATA TyLen and 8-bit length + the text
        always = 1 + len(PAYLOAD_JSON_TAG) + 2 + len(exact_text(value))
        print(f"| {name} | " + " | ".join(cells) + f" | {always} |")


if __name__ == "__main__":
    main()
