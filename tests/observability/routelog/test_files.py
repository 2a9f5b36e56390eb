"""The log directory: hidden-then-renamed files, owner lock, crash recovery."""

from __future__ import annotations

import os
import shutil

import pytest

from broker.observability.routelog.files import LOCK_NAME, LogDirectory, final_name, is_temp


def visible(path) -> list[str]:
    return sorted(n for n in os.listdir(path) if not n.startswith("."))


def jsonl_dir(path, server: int = 1) -> LogDirectory:
    d = LogDirectory(str(path), server)
    d.suffix = ".jsonl"
    return d


def test_file_is_hidden_until_finished(tmp_path):
    d = jsonl_dir(tmp_path, 7)
    d.open()
    f = d.new_file()
    f.write(b'{"a":1}\n')
    assert visible(tmp_path) == []
    assert is_temp(os.path.basename(f.temp_path))
    f.finish()
    assert visible(tmp_path) == [f.name]
    assert f.name.startswith("routelog-7-") and f.name.endswith(".jsonl")
    assert (tmp_path / f.name).read_bytes() == b'{"a":1}\n'
    assert not os.path.exists(f.temp_path)
    d.close()


def test_names_are_unique_and_sort_by_time(tmp_path):
    d = LogDirectory(str(tmp_path), 1)
    d.open()
    names = [d.new_file().name for _ in range(50)]
    assert len(set(names)) == 50 and names == sorted(names)
    assert final_name(1, 0.5, 3) == "routelog-1-19700101T000000.500000Z-000003.parquet"
    assert final_name(1, 0.5, 3, ".jsonl") == "routelog-1-19700101T000000.500000Z-000003.jsonl"
    assert names[0].endswith(".parquet")


def test_second_owner_is_refused(tmp_path):
    first = LogDirectory(str(tmp_path), 1)
    first.open()
    with pytest.raises(OSError, match="in use by another broker"):
        LogDirectory(str(tmp_path), 1).open()
    first.close()
    second = LogDirectory(str(tmp_path), 1)
    second.open()  # the lock went with its owner
    second.close()


def test_unusable_directory_is_reported(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match=r"routing log directory .*file"):
        LogDirectory(str(blocker / "log"), 1).open()


def test_recovery_publishes_complete_lines_only(tmp_path):
    d = jsonl_dir(tmp_path)
    d.open()
    torn = d.new_file()
    torn.write(b'{"n":1}\n{"n":2}\n{"n":3,"tor')
    empty = d.new_file()
    empty.write(b'{"only":"a torn line')
    d.close()  # the broker "died": both files stay hidden
    torn.abandon()
    empty.abandon()
    assert visible(tmp_path) == []
    again = LogDirectory(str(tmp_path), 1)
    result = again.open()
    assert (result.files, result.removed_empty) == (1, 1)
    assert result.torn_bytes == len(b'{"n":3,"tor') + len(b'{"only":"a torn line')
    assert visible(tmp_path) == [torn.name]
    assert (tmp_path / torn.name).read_bytes() == b'{"n":1}\n{"n":2}\n'
    assert [n for n in os.listdir(tmp_path) if n != LOCK_NAME and n.startswith(".")] == []
    again.close()


def test_recovery_finds_a_newline_far_from_the_end(tmp_path):
    d = jsonl_dir(tmp_path)
    d.open()
    f = d.new_file()
    f.write(b"x" * 10 + b"\n" + b"y" * 200_000)  # longer than one tail block
    f.abandon()
    d.close()
    again = LogDirectory(str(tmp_path), 1)
    assert again.open().files == 1
    assert (tmp_path / f.name).read_bytes() == b"x" * 10 + b"\n"
    again.close()


def test_directory_removed_while_a_file_is_open(tmp_path):
    path = tmp_path / "log"
    d = LogDirectory(str(path), 1)
    d.open()
    f = d.new_file()
    f.write(b'{"before":1}\n')
    shutil.rmtree(path)
    f.write(b'{"after":2}\n')
    f.finish()  # the descriptor still has the data: it is copied to a new file
    assert visible(path) == [f.name]
    assert (path / f.name).read_bytes() == b'{"before":1}\n{"after":2}\n'
    g = d.new_file()  # and new files go to the re-made directory
    g.write(b"{}\n")
    g.finish()
    assert visible(path) == sorted([f.name, g.name])
    d.close()


def test_resumable_write_after_a_failure(tmp_path):
    d = LogDirectory(str(tmp_path), 1)
    d.open()
    f = d.new_file()
    real_fd = f.fd
    f.fd = os.open(os.devnull, os.O_RDONLY)  # writes fail with EBADF
    with pytest.raises(OSError):
        f.write(b"0123456789\n")
    os.close(f.fd)
    f.fd = real_fd
    f.drain()  # the retry continues with the pending bytes
    f.finish()
    assert (tmp_path / f.name).read_bytes() == b"0123456789\n"
    d.close()


def test_recovery_removes_an_unfinished_parquet_file_and_keeps_jsonl_ones(tmp_path):
    """A killed Parquet writer's file has no footer: removed and counted; an old
    JSON Lines file of the same directory is still recovered."""
    old = jsonl_dir(tmp_path)
    old.open()
    f = old.new_file()
    f.write(b'{"n":1}\n')
    f.abandon()
    old.suffix = ".parquet"
    p = old.new_file()
    p.write(b"PAR1 row groups but no footer")
    p.abandon()
    old.close()
    again = LogDirectory(str(tmp_path), 1)
    result = again.open()
    assert (result.files, result.removed_unfinished) == (1, 1)
    assert visible(tmp_path) == [f.name]
    assert [n for n in os.listdir(tmp_path) if n != LOCK_NAME and n.startswith(".")] == []
    again.close()
