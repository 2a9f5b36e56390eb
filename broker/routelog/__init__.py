"""The routing log: one JSON Lines record per routed message, in rotating files."""

from broker.routelog.record import FIELDS, RecordBuffer, format_records, json_str
from broker.routelog.writer import RoutingLog

__all__ = ["FIELDS", "RecordBuffer", "RoutingLog", "format_records", "json_str"]
