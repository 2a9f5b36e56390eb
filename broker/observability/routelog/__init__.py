"""The routing log: one JSON Lines record per routed message, in rotating files."""

from broker.observability.routelog.record import FIELDS, RecordBuffer, format_records, json_str
from broker.observability.routelog.writer import RoutingLog

__all__ = ["FIELDS", "RecordBuffer", "RoutingLog", "format_records", "json_str"]
