"""The trainer's step records: complete lines only for readers, a torn last line dropped
by the next trainer before it appends (`trainer.step_records`)."""

import json
import logging

from trainer.step_records import count_rows, open_for_append, read_rows


def _row(step: int) -> bytes:
    return json.dumps({"step": step, "tasks": [str(t) for t in range(step, step + 4)]}).encode() + b"\n"


def test_a_reader_takes_complete_rows_only(tmp_path):
    path = tmp_path / "record.jsonl"
    assert read_rows(path) == [] and count_rows(path) == 0
    path.write_bytes(_row(0) + _row(1) + _row(2)[:20])  # the third still being written
    assert [r["step"] for r in read_rows(path)] == [0, 1]
    assert count_rows(path) == 2


def test_a_torn_last_row_is_dropped_before_the_next_run_appends(tmp_path, caplog):
    path = tmp_path / "runs" / "record.jsonl"
    path.parent.mkdir()
    path.write_bytes(_row(0) + _row(1) + _row(2)[:33])  # a trainer killed while writing step 2
    with caplog.at_level(logging.WARNING), open_for_append(path) as f:
        f.write(_row(2).decode())
    assert [r["step"] for r in read_rows(path)] == [0, 1, 2]
    assert path.read_bytes() == _row(0) + _row(1) + _row(2)
    assert "dropping a torn last row (33 bytes" in caplog.text


def test_a_torn_row_longer_than_a_read_chunk_and_a_file_of_only_a_torn_row(tmp_path):
    path = tmp_path / "record.jsonl"
    path.write_bytes(_row(0) + b'{"step": 1, "tasks": ["' + b"x" * 200_000)
    open_for_append(path).close()
    assert path.read_bytes() == _row(0)
    path.write_bytes(b'{"step": 0, "ta')
    open_for_append(path).close()
    assert path.read_bytes() == b""


def test_a_complete_file_and_a_new_one_are_left_as_they_are(tmp_path, caplog):
    path = tmp_path / "new" / "record.jsonl"
    with caplog.at_level(logging.WARNING):
        with open_for_append(path) as f:  # the folder is made
            f.write(_row(0).decode())
        with open_for_append(path) as f:
            f.write(_row(1).decode())
    assert path.read_bytes() == _row(0) + _row(1)
    assert "torn" not in caplog.text
