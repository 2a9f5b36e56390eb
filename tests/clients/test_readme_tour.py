"""The README's five-minute tour, followed as written against a real broker.

The shell commands are read from the README's tour section (so a README edit
that breaks the tour breaks this test); only the port is changed, since the
test broker listens on free ports, and LNAME is replaced by the responder's
lname as a reader would.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

from tests.brokerproc import ROOT, BrokerProcess
from tests.clients.scripts import ENV, Running, run

README = ROOT / "README.md"


def tour() -> tuple[list[str], str]:
    """The tour's `.venv/bin/...` command lines in order, and its Python snippet."""
    text = README.read_text()
    section = text[text.index("## Five-minute tour"):]
    section = section[:section.index("\n## ", 1)]
    commands = [line.strip() for line in section.splitlines()
                if line.strip().startswith(".venv/bin/")]
    python = re.search(r"```python\n(.*?)```", section, re.S)
    assert python is not None
    return commands, python.group(1)


def stats_shown() -> list[tuple[str, str]]:
    """The (key, value) lines the README's `skan stats` example shows."""
    text = README.read_text()
    block = text[text.index(".venv/bin/skan stats\n"):]
    block = block[:block.index("```")]
    out = []
    for line in block.splitlines()[1:]:
        key, _, value = line.removeprefix("# ").partition(" ")
        value = value.strip()
        if key and key != "uptime" and value not in ("", "..."):
            out.append((key, value))
    return out


def argv(command: str, port: int) -> tuple[str, list[str]]:
    words = shlex.split(command.split("  #")[0])
    name = words[0].removeprefix(".venv/bin/")
    return name, ["--port", str(port), *words[1:]]


def test_tour_commands_are_the_expected_ones():
    commands, _ = tour()
    names = [shlex.split(c)[1] for c in commands]
    assert names == ["sub", "pub", "pub", "stats", "reply", "request", "request"]


def test_readme_tour_end_to_end():
    commands, snippet = tour()
    with BrokerProcess() as broker:
        port = broker.skan[1]
        sub_cmd, pub1, pub2, stats_cmd, reply_cmd, req1, req2 = commands

        name, args = argv(sub_cmd, port)
        sub = Running(name, *args)
        banner = sub.wait_stderr("subscribed to chat/*")
        assert "decimal strings" in banner
        for cmd in (pub1, pub2):
            result = run(*_flat(argv(cmd, port)))
            assert result.returncode == 0, result.stderr
            result.assert_clean()
        first, second = sub.readline(), sub.readline()
        assert re.fullmatch(r"\[chat/\*\] \S+ -> \* seq=1: hello", first), first
        assert second.endswith(' -> * seq=1: {"user": "ana", "n": "1"}'), second

        stats = run(*_flat(argv(stats_cmd, port)))
        assert stats.returncode == 0
        assert re.search(r"^messages_in\s+2$", stats.stdout, re.M), stats.stdout
        assert re.search(r"^connections\s+skan=", stats.stdout, re.M), stats.stdout
        # Every line the README shows (but the uptime and elided values) is printed so.
        shown = stats_shown()
        assert len(shown) >= 3
        for key, value in shown:
            assert re.search(rf"^{key}\s+{re.escape(value)}$", stats.stdout, re.M), (
                key, value, stats.stdout)
        ended = sub.stop()  # Ctrl-C, as the tour says
        assert ended.returncode == 130
        ended.assert_clean()

        name, args = argv(reply_cmd, port)
        responder = Running(name, *args)
        line = responder.wait_stderr("replying to requests on svc/*")
        lname = line.rsplit(" as ", 1)[1].strip()
        answer = run(*_flat(argv(req1, port)))
        assert answer.returncode == 0, answer.stderr
        assert re.fullmatch(rf"\[svc/\*\] {re.escape(lname)} -> \S+ seq=\d+ repl=1: pong",
                            answer.stdout.strip()), answer.stdout
        answer = run(*_flat(argv(req2.replace("LNAME", lname), port)))
        assert answer.returncode == 0, answer.stderr
        assert '"msg": "pong"' in answer.stdout and f'"from": "{lname}"' in answer.stdout
        assert responder.readline().endswith(": ping")
        assert responder.readline().endswith(': {"q": "1"}')
        ended = responder.stop()
        assert ended.returncode == 130
        ended.assert_clean()

        code = snippet.replace("9912", str(port))
        proc = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                              text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().endswith("{'text': 'hi', 'n': '1'}"), proc.stdout


def _flat(pair: tuple[str, list[str]]) -> list[str]:
    name, args = pair
    return [name, *args]
