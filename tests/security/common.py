"""What the security tests share: an in-memory endpoint and a users configuration."""

from __future__ import annotations

import hashlib

from broker.core.router import Endpoint, Routed


class Sink(Endpoint):
    """A routing endpoint that records what it receives (for pure router tests)."""

    def __init__(self, protocol: str = "skan") -> None:
        super().__init__()
        self.protocol = protocol
        self.got: list[Routed] = []

    def deliver(self, frame: bytes, routed: Routed) -> None:
        self.got.append(routed)


SENSOR_TOKEN = "sensor-token"
DASH_TOKEN = "dash-token"
OP_TOKEN = "op-token"

# Users of section 7's examples: a sensor that may only publish telemetry, a
# dashboard that may only subscribe, an operator with promisc.
USERS = f"""
[auth]
allow_anonymous = false

[[users]]
name = "sensor"
token = "{SENSOR_TOKEN}"
publish = ["telemetry", "alarms.*"]
subscribe = ["commands.sensor"]

[[users]]
name = "dashboard"
token_sha256 = "{hashlib.sha256(DASH_TOKEN.encode()).hexdigest()}"
subscribe = ["telemetry", "alarms.*"]

[[users]]
name = "operator"
token = "{OP_TOKEN}"
publish = ["*"]
subscribe = ["*"]
promisc = true
max_connections = 3
"""
