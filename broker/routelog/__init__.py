"""The routing log: one JSON Lines record per routed message, in rotating files."""

from broker.routelog.record import FIELDS, RecordFormatter, json_str
from broker.routelog.writer import RoutingLog

__all__ = ["FIELDS", "RecordFormatter", "RoutingLog", "json_str"]
