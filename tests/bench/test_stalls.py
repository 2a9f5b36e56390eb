"""bench.compare.stalls: how the latency probe's slowest 1 % came."""

from __future__ import annotations

from bench.compare import STALL_GAP_NS, stalls

MS = 1_000_000


def _steady(n: int, every: int = 100_000, lat: int = 50_000) -> list[tuple[int, int]]:
    return [(i * every, i * every + lat) for i in range(n)]


def test_a_pause_is_one_stall_spanning_its_slow_messages() -> None:
    samples = _steady(10_000)
    # A 20 ms pause at 300 ms: everything sent in it comes out at its end.
    end = 320 * MS
    samples = [(s, max(g, end)) if 300 * MS <= s < end else (s, g) for s, g in samples]
    runs = stalls(samples)
    assert len(runs) == 1
    first, last = runs[0]
    # The slowest 1 % (100 messages) are the first 10 ms of the pause's.
    assert first == 300 * MS and last == end


def test_stalls_apart_are_counted_apart_longest_first() -> None:
    samples = _steady(10_000)
    slow = {100: 5 * MS, 101: 5 * MS, 5000: 9 * MS, 5001: 9 * MS, 5002: 9 * MS}
    samples = [(s, s + slow.get(i, 0) + 50_000) for i, (s, _) in enumerate(samples)]
    runs = stalls(samples, share=5 / 10_000)
    assert [(r[0] // 100_000) for r in runs] == [5000, 100]
    assert runs[0][1] - runs[0][0] == 2 * 100_000 + 9 * MS + 50_000


def test_slow_messages_closer_than_the_gap_are_one_stall() -> None:
    gap = STALL_GAP_NS // 100_000  # messages between two slow ones at the gap
    samples = _steady(10_000)
    slow = {200, 200 + gap - 1, 4000, 4000 + gap}
    samples = [(s, g + (3 * MS if i in slow else 0)) for i, (s, g) in enumerate(samples)]
    assert len(stalls(samples, share=4 / 10_000)) == 3
    assert stalls([]) == []
