"""The child's output bytes, split into bounded lines."""

from __future__ import annotations

from engy_node.miner.sglang.output_lines import TRUNCATION_MARK, LineBuffer


def test_output_is_split_into_lines_across_reads_at_newlines_and_carriage_returns():
    buffer = LineBuffer(max_line_bytes=100)
    assert buffer.feed(b"first li") == []
    assert buffer.feed(b"ne\nLoading 10%\rLoading 20%\r\n\nlast") == ["first line", "Loading 10%", "Loading 20%"]
    assert buffer.flush() == ["last"]
    assert buffer.truncated == 0


def test_an_overlong_line_is_cut_marked_and_counted_and_the_rest_is_not_kept():
    buffer = LineBuffer(max_line_bytes=10)
    assert buffer.feed(b"0123456789abc") == ["0123456789" + TRUNCATION_MARK]
    assert buffer.feed(b"def" * 1000) == []
    assert buffer.feed(b"ghi\nshort\n" + b"y" * 11 + b"\n") == ["short", "yyyyyyyyyy" + TRUNCATION_MARK]
    assert buffer.truncated == 2
    assert len(buffer._partial) == 0


def test_bytes_that_are_not_utf8_are_replaced_not_fatal():
    assert LineBuffer(max_line_bytes=100).feed(b"bad \xff byte\n") == ["bad \ufffd byte"]
