"""Eventer messages (HatEventer SBS module) as attrs classes, and their SBS values.

Pure: hat-sbs values in and out (dicts, ``(name, value)`` choices,
``('none', None)``/``('value', x)`` optionals), no I/O.  Events, ids,
timestamps and payloads are the shared Hat event model (:mod:`wire.hat`);
this module adds the Eventer-only messages (registrations, queries, init)
and the SBS form of all of them.  Eventer has no SBS payload kind: an
:class:`~wire.hat.SbsPayload` goes out as its binary form (``"sbs:M.T"``).
"""

from __future__ import annotations

import enum
import json
from typing import Any

import attrs

from wire import boundedjson
from wire.chatter import sbs
from wire.errors import LocalProtocolError
from wire.hat import (
    BinaryPayload,
    Event,
    EventId,
    EventType,
    JsonPayload,
    Payload,
    SbsPayload,
    Timestamp,
)
from wire.limits import MAX_PAYLOAD_ITEMS, ItemBudget


class Status(enum.Enum):
    STANDBY = "standby"
    STARTING = "starting"
    OPERATIONAL = "operational"
    STOPPING = "stopping"


class Order(enum.Enum):
    DESCENDING = "descending"
    ASCENDING = "ascending"


class OrderBy(enum.Enum):
    TIMESTAMP = "timestamp"
    SOURCE_TIMESTAMP = "sourceTimestamp"


@attrs.frozen
class RegisterEvent:
    type: EventType
    source_timestamp: Timestamp | None = None
    payload: Payload = None


@attrs.frozen
class QueryLatestParams:
    event_types: tuple[EventType, ...] | None = None


@attrs.frozen
class QueryTimeseriesParams:
    event_types: tuple[EventType, ...] | None = None
    t_from: Timestamp | None = None
    t_to: Timestamp | None = None
    source_t_from: Timestamp | None = None
    source_t_to: Timestamp | None = None
    order: Order = Order.DESCENDING
    order_by: OrderBy = OrderBy.TIMESTAMP
    max_results: int | None = None
    last_event_id: EventId | None = None


@attrs.frozen
class QueryServerParams:
    server_id: int
    persisted: bool = False
    max_results: int | None = None
    last_event_id: EventId | None = None


QueryParams = QueryLatestParams | QueryTimeseriesParams | QueryServerParams


@attrs.frozen
class QueryResult:
    events: tuple[Event, ...]
    more_follows: bool


@attrs.frozen
class InitReq:
    client_name: str
    client_token: str | None = None
    subscriptions: tuple[EventType, ...] = ()
    server_id: int | None = None
    persisted: bool = False


# ---- optionals, ids, timestamps ---------------------------------------------


def _opt_to(value: Any, fn: Any = None) -> tuple[str, Any]:
    if value is None:
        return ("none", None)
    return ("value", fn(value) if fn else value)


def _opt_from(value: tuple[str, Any], fn: Any = None) -> Any:
    if value[0] == "none":
        return None
    return fn(value[1]) if fn else value[1]


def timestamp_to_sbs(t: Timestamp) -> dict[str, int]:
    return {"s": t.s, "us": t.us}


def timestamp_from_sbs(v: dict[str, int]) -> Timestamp:
    return Timestamp(v["s"], v["us"])


def event_id_to_sbs(e: EventId) -> dict[str, int]:
    return {"server": e.server, "session": e.session, "instance": e.instance}


def event_id_from_sbs(v: dict[str, int]) -> EventId:
    return EventId(v["server"], v["session"], v["instance"])


def status_to_sbs(status: Status) -> tuple[str, None]:
    return (status.value, None)


def status_from_sbs(v: tuple[str, Any]) -> Status:
    return Status(v[0])


# ---- payloads and events ----------------------------------------------------


def json_text(data: Any) -> str:
    """JSON text of a payload value (what EventPayloadJson carries)."""
    try:
        return json.dumps(data, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise LocalProtocolError(f"payload is not JSON-serialisable: {exc}") from None


def payload_to_sbs(p: BinaryPayload | JsonPayload | SbsPayload) -> tuple[str, Any]:
    if isinstance(p, SbsPayload):
        p = p.to_binary()
    if isinstance(p, BinaryPayload):
        return ("binary", {"type": p.type, "data": p.data})
    return ("json", json_text(p.data))


def payload_from_sbs(
    v: tuple[str, Any], budget: ItemBudget | None = None
) -> BinaryPayload | JsonPayload:
    """A payload from its SBS value; a json payload is parsed within the decoder
    limits (MAX_PAYLOAD_ITEMS on its own, so the Skan message built from it
    passes MAX_ITEMS), charged to ``budget`` (the message's) when given."""
    if v[0] == "binary":
        return BinaryPayload(v[1]["type"], bytes(v[1]["data"]))
    return JsonPayload(boundedjson.loads(
        v[1], what="json payload", budget=budget, max_items=MAX_PAYLOAD_ITEMS
    ))


def _event_type(v: list[str]) -> EventType:
    return tuple(v)


def event_to_sbs(e: Event) -> dict[str, Any]:
    return {
        "id": event_id_to_sbs(e.id),
        "type": list(e.type),
        "timestamp": timestamp_to_sbs(e.timestamp),
        "sourceTimestamp": _opt_to(e.source_timestamp, timestamp_to_sbs),
        "payload": _opt_to(e.payload, payload_to_sbs),
    }


def event_from_sbs(v: dict[str, Any], budget: ItemBudget | None = None) -> Event:
    return Event(
        id=event_id_from_sbs(v["id"]),
        type=_event_type(v["type"]),
        timestamp=timestamp_from_sbs(v["timestamp"]),
        source_timestamp=_opt_from(v["sourceTimestamp"], timestamp_from_sbs),
        payload=_opt_from(v["payload"], lambda p: payload_from_sbs(p, budget)),
    )


def register_event_to_sbs(e: RegisterEvent) -> dict[str, Any]:
    return {
        "type": list(e.type),
        "sourceTimestamp": _opt_to(e.source_timestamp, timestamp_to_sbs),
        "payload": _opt_to(e.payload, payload_to_sbs),
    }


def register_event_from_sbs(
    v: dict[str, Any], budget: ItemBudget | None = None
) -> RegisterEvent:
    return RegisterEvent(
        type=_event_type(v["type"]),
        source_timestamp=_opt_from(v["sourceTimestamp"], timestamp_from_sbs),
        payload=_opt_from(v["payload"], lambda p: payload_from_sbs(p, budget)),
    )


def events_from_sbs(v: list[dict[str, Any]], budget: ItemBudget | None = None
                    ) -> tuple[Event, ...]:
    """The events of a MsgEventsNotify (and of a MsgRegisterRes, a MsgQueryRes)."""
    return tuple(event_from_sbs(e, budget) for e in v)


def register_events_from_sbs(v: list[dict[str, Any]], budget: ItemBudget | None = None
                             ) -> tuple[RegisterEvent, ...]:
    """The events a MsgRegisterReq asks to register."""
    return tuple(register_event_from_sbs(e, budget) for e in v)


def register_result_from_sbs(v: tuple[str, Any], budget: ItemBudget | None = None
                             ) -> tuple[Event, ...] | None:
    """MsgRegisterRes: the registered events, or None when the server refused them."""
    kind, value = v
    return events_from_sbs(value, budget) if kind == "events" else None


def encode_event(e: Event) -> bytes:
    """One ``HatEventer.Event`` encoding (elements of EventsNotify/RegisterRes/QueryRes)."""
    return sbs.encode("HatEventer.Event", event_to_sbs(e))


# ---- queries -------------------------------------------------------------------


def _types_to(types: tuple[EventType, ...] | None) -> tuple[str, Any]:
    return _opt_to(types, lambda ts: [list(t) for t in ts])


def _types_from(v: tuple[str, Any]) -> tuple[EventType, ...] | None:
    return _opt_from(v, lambda ts: tuple(tuple(t) for t in ts))


def query_params_to_sbs(p: QueryParams) -> tuple[str, Any]:
    if isinstance(p, QueryLatestParams):
        return ("latest", {"eventTypes": _types_to(p.event_types)})
    if isinstance(p, QueryTimeseriesParams):
        return ("timeseries", {
            "eventTypes": _types_to(p.event_types),
            "tFrom": _opt_to(p.t_from, timestamp_to_sbs),
            "tTo": _opt_to(p.t_to, timestamp_to_sbs),
            "sourceTFrom": _opt_to(p.source_t_from, timestamp_to_sbs),
            "sourceTTo": _opt_to(p.source_t_to, timestamp_to_sbs),
            "order": (p.order.value, None),
            "orderBy": (p.order_by.value, None),
            "maxResults": _opt_to(p.max_results),
            "lastEventId": _opt_to(p.last_event_id, event_id_to_sbs),
        })
    return ("server", {
        "serverId": p.server_id,
        "persisted": p.persisted,
        "maxResults": _opt_to(p.max_results),
        "lastEventId": _opt_to(p.last_event_id, event_id_to_sbs),
    })


def query_params_from_sbs(v: tuple[str, Any]) -> QueryParams:
    kind, d = v
    if kind == "latest":
        return QueryLatestParams(_types_from(d["eventTypes"]))
    if kind == "timeseries":
        return QueryTimeseriesParams(
            event_types=_types_from(d["eventTypes"]),
            t_from=_opt_from(d["tFrom"], timestamp_from_sbs),
            t_to=_opt_from(d["tTo"], timestamp_from_sbs),
            source_t_from=_opt_from(d["sourceTFrom"], timestamp_from_sbs),
            source_t_to=_opt_from(d["sourceTTo"], timestamp_from_sbs),
            order=Order(d["order"][0]),
            order_by=OrderBy(d["orderBy"][0]),
            max_results=_opt_from(d["maxResults"]),
            last_event_id=_opt_from(d["lastEventId"], event_id_from_sbs),
        )
    return QueryServerParams(
        server_id=d["serverId"],
        persisted=d["persisted"],
        max_results=_opt_from(d["maxResults"]),
        last_event_id=_opt_from(d["lastEventId"], event_id_from_sbs),
    )


def query_result_from_sbs(v: dict[str, Any], budget: ItemBudget | None = None) -> QueryResult:
    return QueryResult(events_from_sbs(v["events"], budget), v["moreFollows"])


def encode_query_result(encoded_events: list[bytes], more_follows: bool) -> bytes:
    """MsgQueryRes data from already-encoded events (Record: events, moreFollows)."""
    return sbs.encode_array(encoded_events) + (b"\x01" if more_follows else b"\x00")


def encode_register_result(encoded_events: list[bytes] | None) -> bytes:
    """MsgRegisterRes data: Choice events (0) with the events, or failure (1)."""
    if encoded_events is None:
        return sbs.encode_integer(1)
    return sbs.encode_integer(0) + sbs.encode_array(encoded_events)


def init_req_to_sbs(r: InitReq) -> dict[str, Any]:
    return {
        "clientName": r.client_name,
        "clientToken": _opt_to(r.client_token),
        "subscriptions": [list(s) for s in r.subscriptions],
        "serverId": _opt_to(r.server_id),
        "persisted": r.persisted,
    }


def init_req_from_sbs(v: dict[str, Any]) -> InitReq:
    return InitReq(
        client_name=v["clientName"],
        client_token=_opt_from(v["clientToken"]),
        subscriptions=tuple(tuple(s) for s in v["subscriptions"]),
        server_id=_opt_from(v["serverId"]),
        persisted=v["persisted"],
    )
