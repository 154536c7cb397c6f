"""A timing model in place of the reference worker's model math (`disagg worker --simulate`).

Owns `Timing` (how long a step and a KV transfer would take on the hardware it stands for), its
presets, and `SimulatedModel`, which sleeps that long and returns cheap logits. It must not
change anything else: the scheduler, the KV blocks and the HTTP API stay the real ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from disagg.engine.model import ForwardItem, Model, ModelConfig

__all__ = ["PRESETS", "SimulatedModel", "Timing"]

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class Timing:
    """How long the simulated hardware takes; a rate of 0 means instant."""

    prefill_tokens_per_s: float
    decode_step_s: float  # one decode step, whatever the batch
    decode_step_per_seq_s: float  # plus this much per sequence in the batch
    kv_bytes_per_token: int  # the real model's KV size, for the transfer time
    kv_bandwidth_bytes_per_s: float
    token_period_s: float = 0.0  # steps at least this far apart (1.0: one token/s a stream)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"Timing.{f.name} must be a finite number >= 0, got {value}")

    def step_s(self, prefill_tokens: int, decode_seqs: int) -> float:
        """One step that prefills `prefill_tokens` and decodes one token of `decode_seqs`."""
        total = 0.0
        if prefill_tokens and self.prefill_tokens_per_s:
            total += prefill_tokens / self.prefill_tokens_per_s
        if decode_seqs:
            total += self.decode_step_s + self.decode_step_per_seq_s * decode_seqs
        return total

    def transfer_s(self, num_tokens: int) -> float:
        """Moving the KV of `num_tokens` tokens between workers."""
        if num_tokens <= 0 or not self.kv_bandwidth_bytes_per_s:
            return 0.0
        return num_tokens * self.kv_bytes_per_token / self.kv_bandwidth_bytes_per_s


PRESETS: dict[str, Timing] = {
    # No sleeps at all: what is left is the orchestrator's and the worker's own cost.
    "zero": Timing(0.0, 0.0, 0.0, 0, 0.0),
    # One H100 serving an 8B Llama: 32 layers x 8 KV heads x 128 x (K, V) x 2 bytes a token.
    "gpu": Timing(20_000.0, 0.008, 0.000_06, 131_072, 25e9),
    # One token per second per stream: thousands of streams open at almost no cost.
    "slow": Timing(0.0, 0.0, 0.0, 0, 0.0, token_period_s=1.0),
}

# The smallest config the real KV cache and transfer code accept: each token's KV is 4 floats.
# The vocabulary is the byte tokenizer's (bytes, BOS, EOS, PAD).
CONFIG = ModelConfig(
    vocab_size=259,
    hidden_size=2,
    intermediate_size=1,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    dtype="float32",
    max_position=131072,  # it stands for a long-context model
)

# What the simulated model "writes": printable bytes, picked by position, so outputs differ
# along a sequence but are the same for the same request on any worker.
_TEXT = np.frombuffer(b"the quick brown fox jumps over the lazy dog. ", dtype=np.uint8)
_UNLIKELY = -1e9  # every other token: never sampled, at any temperature


class SimulatedModel(Model):
    """Takes the place of `Model` for the scheduler and the worker: `forward` waits as long
    as `timing` says the step would take, and returns logits that pick one printable byte
    with probability 1 (never EOS, so every output runs to max_tokens).

    A one-token item is counted as a decode, a longer one as prefill. `sleep` and `clock` are
    injectable for tests; `forward` runs on the scheduler thread, never on the event loop.
    """

    def __init__(
        self,
        timing: Timing,
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Model.__init__ is not called: there are no weights, only `config` and the KV shape.
        self.config = CONFIG
        self.timing = timing
        self._sleep, self._clock = sleep, clock
        self._last_end = -math.inf  # when the previous step ended (for token_period_s)

    def weights(self) -> dict[str, Array]:
        raise TypeError("a simulated model has no weights")

    def forward(self, items: Sequence[ForwardItem], kv: Array) -> Array:
        if not items:
            return np.zeros((0, self.config.vocab_size), dtype=np.float64)
        sizes = [len(item.token_ids) for item in items]
        prefill = sum(n for n in sizes if n > 1)
        self._wait(self.timing.step_s(prefill, sizes.count(1)))
        return _logits(items, self.config.vocab_size)

    def _wait(self, work_s: float) -> None:
        """Sleep for the step's work, and at least until `token_period_s` after the last."""
        now = self._clock()
        delay = max(work_s, self._last_end + self.timing.token_period_s - now)
        if delay > 0:
            self._sleep(delay)
        # From the intended end, not the measured one: oversleeping does not drift the period.
        self._last_end = now + max(delay, 0.0)


def _logits(items: Sequence[ForwardItem], vocab_size: int) -> Array:
    """One row per item, 0 for the byte of `_TEXT` at the position it samples, else -1e9."""
    logits = np.full((len(items), vocab_size), _UNLIKELY, dtype=np.float64)
    positions = np.array([item.start_pos + len(item.token_ids) for item in items])
    logits[np.arange(len(items)), _TEXT[positions % len(_TEXT)]] = 0.0
    return logits
