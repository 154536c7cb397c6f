"""The leg-timing wire format and the clock-offset estimate: well-formed reports round-trip,
malformed ones are refused, the SSE event is cut out exactly, and the NTP-style offset is
right for any shift within half the round trip's delay."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from disagg import leg_timing
from disagg.clock_offsets import ClockOffsets, sample
from disagg.leg_timing import HEADER_BUDGET, LegTiming

GOOD = LegTiming(received=100.0, responded=100.5, scheduled=100.1, first_token=100.2)


def test_reports_round_trip() -> None:
    assert leg_timing.decode(leg_timing.encode_header(GOOD)) == GOOD
    event = leg_timing.encode_event(GOOD)
    rest, data = leg_timing.split_event(b'data: {"a": 1}\n\n' + event + b"data: [DONE]\n\n")
    assert rest == b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert data is not None and leg_timing.decode(data) == GOOD
    assert len(leg_timing.encode_header(GOOD)) <= HEADER_BUDGET


def test_chunks_without_the_event_pass_unchanged() -> None:
    chunk = b'data: {"text": "event: disagg.leg_timing"}\n\n'
    assert leg_timing.split_event(chunk) == (chunk, None)


def test_malformed_reports_are_refused() -> None:
    for raw in (
        b"",
        b"not json",
        b"[]",
        b'{"received": 1.0}',  # no responded
        b'{"received": "1", "responded": 2}',
        b'{"received": 5.0, "responded": 4.0}',  # answered before it arrived
        b'{"received": 5.0, "responded": 6.0, "first_token": 4.0}',
        b'{"received": 5.0, "responded": 6.0, "kv_transfer_start": 5.5, "kv_transfer_end": 5.2}',
        b'{"received": 5.0, "responded": 6.0, "kv_transfer_bytes": -1}',
        b'{"received": 1e400, "responded": 1e400}',
    ):
        assert leg_timing.decode(raw) is None, raw


@given(
    shift=st.floats(-1e6, 1e6, allow_nan=False),
    t1=st.floats(0, 1e5),
    out=st.floats(0, 0.5),  # one-way delays, seconds
    back=st.floats(0, 0.5),
    work=st.floats(0, 10),
)
def test_offset_is_within_half_the_delay(
    shift: float, t1: float, out: float, back: float, work: float
) -> None:
    t2 = t1 + out + shift
    t3 = t2 + work
    t4 = t1 + out + work + back
    s = sample(t1, t2, t3, t4)
    assert s is not None
    assert math.isclose(s.delay, out + back, abs_tol=1e-6)
    assert abs(s.offset - shift) <= s.delay / 2 + 1e-6


def test_the_least_delayed_sample_wins() -> None:
    offsets = ClockOffsets()
    for exchange in (
        (0.0, 10.5, 10.5, 1.0),  # delay 1 s
        (5.0, 15.01, 15.02, 5.03),  # delay 20 ms, offset 10 s
        (8.0, 18.4, 18.4, 8.5),  # delay 0.5 s
    ):
        s = sample(*exchange)
        assert s is not None
        offsets.add("w", s)
    best = offsets.best("w")
    assert best is not None and math.isclose(best.offset, 10.0, abs_tol=1e-9)
    assert offsets.to_local("w", 25.0) == 25.0 - best.offset
    assert offsets.best("other") is None and offsets.to_local("other", 1.0) is None
    offsets.forget({"other"})
    assert offsets.best("w") is None


def test_an_impossible_exchange_is_no_sample() -> None:
    assert sample(0.0, 10.0, 11.0, 0.5) is None  # the worker took longer than the round trip
    assert sample(1.0, 10.0, 10.0, 0.5) is None  # answered before it was sent
