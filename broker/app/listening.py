"""The ``listening`` lines a broker prints once every listener is up, and how to read them.

``listening <protocol> <host>:<port>``, one per listener, all in one write:
a supervisor reading the pipe (skan-broker's workers parent, the tests'
broker runner) knows the list is whole once a read holds the skan line and
ends a line.
"""

from __future__ import annotations

import sys


def print_listening(lines: list[str]) -> None:
    """The lines in one write, so a reader sees all of them or none.

    A few hundred bytes stay under PIPE_BUF (4 KiB), which the kernel never
    splits; unbuffered stdout (``python -u``, PYTHONUNBUFFERED) would
    otherwise write them line by line.
    """
    sys.stdout.write("".join(line + "\n" for line in lines))
    sys.stdout.flush()


def all_listening(output: bytes) -> bool:
    """Whether ``output`` read so far holds the whole list of ``listening`` lines."""
    return b"listening skan" in output and output.endswith(b"\n")
