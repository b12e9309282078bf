"""`streams._raw_entries`: a raw XREAD or XREADGROUP reply (RESP2's list of [stream,
entries] pairs or RESP3's map) as `Entry(stream, id, fields)`, in the server's order: one
field or several, and None for an entry deleted while it was pending."""

from pipeline.streams import Entry, _raw_entries


def test_one_field_several_and_a_deleted_entry_in_either_reply_form():
    pairs = [(b"rs:a", [(b"1-0", [b"m", b"x"]), (b"1-1", None)]),
             (b"rs:b", [(b"2-0", [b"f", b"1", b"g", b"2", b"f", b"3"]), (b"2-1", [])])]
    want = [Entry("rs:a", b"1-0", {b"m": b"x"}), Entry("rs:a", b"1-1", None),
            Entry("rs:b", b"2-0", {b"f": b"3", b"g": b"2"}), Entry("rs:b", b"2-1", {})]
    assert _raw_entries(pairs) == want
    assert _raw_entries(dict(pairs)) == want
    assert _raw_entries(None) == [] and _raw_entries([]) == []
