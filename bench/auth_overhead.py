"""Cost of permission checks (section 7): 1->1 and 1->10 with users configured and without.

    python -m bench.auth_overhead                  # 3 rounds of 5 s per case
    python -m bench.auth_overhead --rounds 5 --seconds 8
    python -m bench.auth_overhead --rounds 0       # in-process part only

"On" is a broker with [[users]] whose connections carry restricted
permissions (group-pattern lists with exact names and prefixes, so every
send runs the real publish check); "off" is the open default where
endpoints have full rights (one ``is None`` test per send).  The load
clients connect anonymously, and ``anonymous_user`` gives them a
restricted user's permissions: the same check an authenticated user pays,
without changing the shared load generator.

First in-process, free of socket noise: the transport's per-chunk work
(split, decode, check, route, queue) on 256 KiB chunks of 100-byte
messages; best of interleaved runs.  Then end to end, alternating on/off
brokers per round (see bench/onoff.py).  Target: at most 5 % cost.
"""

from __future__ import annotations

import argparse
import time

import trio

from bench.onoff import compare, fan_out, in_process, parse_args, route_chunk
from broker.core.auth import Authenticator, Permissions, User
from broker.core.router import Router

# Realistic pattern lists: a few exact groups, then prefixes; "bench" groups
# match a prefix near the end, the slowest path of an uncached check.
PUBLISH = ["telemetry", "alarms.fire", "commands.x", "status.*", "bench*"]
SUBSCRIBE = ["telemetry", "alarms.*", "commands.*", "bench*"]


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


ON = f"""
[auth]
allow_anonymous = true
anonymous_user = "bench-user"

[[users]]
name = "bench-user"
publish = {_toml_list(PUBLISH)}
subscribe = {_toml_list(SUBSCRIBE)}

[[users]]
name = "someone-else"
token = "not used"
publish = ["*"]
subscribe = ["*"]
"""
OFF = ""


def chunk_cost(subscribers: int, users: bool, chunks: int = 20) -> float:
    """Best seconds per message over ``chunks`` 256 KiB chunks through the real routing path."""
    router = Router()
    if users:
        user = User("bench-user", None, Permissions("bench-user", PUBLISH, SUBSCRIBE), None)
        router.enforcer.auth = Authenticator([user], allow_anonymous=True,
                                             anonymous_user="bench-user")
    pub, subs, chunk, per_chunk = fan_out(router, subscribers)
    assert (pub.perms is not None) == users
    best = float("inf")
    for _ in range(chunks):
        for conn in (pub, *subs):
            conn.queue.take_all()
        start = time.perf_counter()
        route_chunk(router, pub, chunk)
        best = min(best, time.perf_counter() - start)
    delivered = sum(s.msgs_out for s in subs)
    assert delivered == chunks * per_chunk * subscribers, "messages were refused or lost"
    return best / per_chunk


async def main(args: argparse.Namespace) -> None:
    # 40 interleaved rounds: the difference is ~50 ns a message, so many
    # samples are needed for the best-of to settle on a busy machine.
    in_process("users", chunk_cost, rounds=40)
    if args.rounds:
        await compare("users", ON, OFF, args)


if __name__ == "__main__":
    trio.run(main, parse_args(__doc__))
