"""The simulated model: the time a step and a KV transfer take under each timing, measured
with an injected sleep and clock (never wall time), and outputs that always run to
max_tokens through the real scheduler and KV blocks."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.engine.kv_cache import BlockManager
from disagg.engine.model import ForwardItem, sample
from disagg.engine.scheduler import Event, SamplingParams, Scheduler, Sequence
from disagg.engine.simulated import PRESETS, SimulatedModel, Timing
from disagg.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer

GPU = PRESETS["gpu"]


class FakeTime:
    """A clock that only moves when the model sleeps; records each sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now

    def model(self, timing: Timing) -> SimulatedModel:
        return SimulatedModel(timing, sleep=self.sleep, clock=self.clock)


def prefill(n: int, start: int = 0) -> ForwardItem:
    return ForwardItem(np.arange(n) % 256, start, list(range(-(-(start + n) // 16))))


def decode(pos: int) -> ForwardItem:
    return ForwardItem(np.array([65]), pos, list(range(pos // 16 + 1)))


def kv(model: SimulatedModel) -> np.ndarray:
    return np.zeros(model.kv_shape(64, 16), dtype=model.config.dtype)


def test_prefill_takes_tokens_over_rate() -> None:
    t = FakeTime()
    m = t.model(GPU)
    m.forward([prefill(2000)], kv(m))
    assert t.sleeps == [pytest.approx(2000 / 20_000)]


def test_decode_takes_base_plus_per_sequence() -> None:
    t = FakeTime()
    m = t.model(GPU)
    m.forward([decode(10 + i) for i in range(32)], kv(m))
    assert t.sleeps == [pytest.approx(0.008 + 32 * 0.000_06)]


def test_mixed_step_is_the_sum() -> None:
    t = FakeTime()
    m = t.model(GPU)
    m.forward([prefill(500), decode(40), decode(41), prefill(300, 16)], kv(m))
    assert t.sleeps == [pytest.approx(800 / 20_000 + 0.008 + 2 * 0.000_06)]
    assert GPU.step_s(800, 2) == pytest.approx(t.sleeps[0])


def test_zero_preset_never_sleeps() -> None:
    t = FakeTime()
    m = t.model(PRESETS["zero"])
    for step in range(50):
        m.forward([prefill(300), decode(step + 1)], kv(m))
    assert t.sleeps == []
    assert PRESETS["zero"].transfer_s(10_000) == 0.0


def test_token_period_spaces_steps() -> None:
    t = FakeTime()
    m = t.model(PRESETS["slow"])
    ends = []
    for step in range(5):
        m.forward([decode(step + 1)], kv(m))
        ends.append(t.now)
        t.now += 0.25  # the scheduler's own work between steps
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    assert gaps == [pytest.approx(1.0)] * 4


def test_token_period_with_slower_steps_adds_nothing() -> None:
    t = FakeTime()
    m = t.model(Timing(0.0, 2.0, 0.0, 0, 0.0, token_period_s=1.0))
    m.forward([decode(1)], kv(m))
    m.forward([decode(2)], kv(m))
    assert t.sleeps == [2.0, 2.0]


def test_transfer_time() -> None:
    assert GPU.transfer_s(2000) == pytest.approx(2000 * 131_072 / 25e9)
    assert GPU.transfer_s(0) == 0.0


def test_negative_or_infinite_timing_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_step_s"):
        Timing(0.0, -1.0, 0.0, 0, 0.0)
    with pytest.raises(ValueError, match="kv_bandwidth"):
        Timing(0.0, 0.0, 0.0, 0, math.inf)


@given(
    pos=st.integers(0, 4000),
    temperature=st.sampled_from([0.0, 0.01, 1.0, 2.0]),
    top_p=st.sampled_from([0.1, 1.0]),
    top_k=st.sampled_from([0, 1, 50]),
)
def test_sampling_picks_a_printable_byte(
    pos: int, temperature: float, top_p: float, top_k: int
) -> None:
    m = SimulatedModel(PRESETS["zero"])
    logits = m.forward([decode(pos)], kv(m))
    token, _ = sample(logits[0], temperature, top_p, top_k, np.random.default_rng(pos))
    assert token == int(np.argmax(logits[0]))
    assert 32 <= token < 127


def test_outputs_run_to_max_tokens() -> None:
    model, tok = SimulatedModel(PRESETS["zero"]), ByteTokenizer()
    bm = BlockManager(model.kv_shape(256, 16), model.config.dtype)
    sched = Scheduler(model, tok, bm, max_batched_tokens=64)
    events: dict[int, list[Event]] = {}
    seqs = []
    for i, max_tokens in enumerate((1, 7, 100, 300)):
        prompt = [256, *b"prompt number %d, with a few words" % i]
        seq = Sequence(
            seq_id=sched.next_id(),
            prompt_ids=prompt * (i + 1),
            params=SamplingParams(max_tokens, temperature=1.0),
            sink=events.setdefault(i, []).append,
            detok=IncrementalDetokenizer(tok),
        )
        sched.submit(seq)
        seqs.append(seq)
    for _ in range(400):
        sched.step()
    for i, seq in enumerate(seqs):
        assert events[i][-1].finish_reason == "length"
        assert len(seq.output_ids) == seq.params.max_tokens
        assert tok.eos_id not in seq.output_ids
        assert seq.text == tok.decode(seq.output_ids) and seq.text.isprintable()
    assert len(set(seqs[-1].text)) > 5
    assert bm.stats()["used"] == 0
