"""Tests for the NumPy reference model, sampling and tokenizers (no I/O, no asyncio)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from disagg.engine.model import ForwardItem, Model, ModelConfig, init_weights, sample
from disagg.engine.tokenizer import ByteTokenizer, IncrementalDetokenizer, render_chat

BLOCK = 4


@pytest.fixture(scope="module")
def tiny() -> Model:
    return Model.tiny()


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.int64)


def _kv(model: Model, num_blocks: int = 32) -> np.ndarray:
    return np.zeros(model.kv_shape(num_blocks, BLOCK), dtype=model.config.dtype)


def _cached(kv: np.ndarray, table: list[int], length: int) -> np.ndarray:
    """The K/V of positions < length in logical order: (layers, 2, length, kvh, hd)."""
    blocks = kv[:, :, table]
    return blocks.reshape(*kv.shape[:2], -1, *kv.shape[4:])[:, :, :length]


def _run_chunks(
    model: Model, tokens: np.ndarray, cuts: list[int], table: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    kv = _kv(model)
    logits = np.empty(0)
    bounds = [0, *cuts, len(tokens)]
    for a, b in itertools.pairwise(bounds):
        logits = model.forward([ForwardItem(tokens[a:b], a, table)], kv)
    return logits[0], _cached(kv, table, len(tokens))


def test_config_shapes(tiny: Model) -> None:
    c = tiny.config
    assert c.head_dim == 32
    assert (c.num_heads, c.num_kv_heads) == (8, 2)
    assert tiny.kv_shape(10, 16) == (4, 2, 10, 16, 2, 32)
    with pytest.raises(ValueError):
        ModelConfig(10, 64, 128, 1, num_heads=4, num_kv_heads=3)


def test_prefill_chunks_and_decode_agree(tiny: Model) -> None:
    tokens = _prompt(1, 23)
    table = list(range(8))
    whole, kv_whole = _run_chunks(tiny, tokens, [], table)
    chunked, kv_chunked = _run_chunks(tiny, tokens, [5, 6, 13], table)
    stepwise, kv_step = _run_chunks(tiny, tokens, list(range(1, 23)), table)
    for logits, kv in ((chunked, kv_chunked), (stepwise, kv_step)):
        np.testing.assert_allclose(logits, whole, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(kv, kv_whole, rtol=1e-10, atol=1e-12)


def test_permuted_block_table(tiny: Model) -> None:
    tokens = _prompt(2, 19)
    base, kv_base = _run_chunks(tiny, tokens, [7], list(range(5)))
    table = [17, 3, 29, 0, 11]
    permuted, kv_perm = _run_chunks(tiny, tokens, [7], table)
    np.testing.assert_allclose(permuted, base, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(kv_perm, kv_base, rtol=1e-10, atol=1e-12)


def test_batch_equals_alone(tiny: Model) -> None:
    # Mixed batch: a fresh prefill, a continued prefill chunk and two decode steps.
    specs = [(_prompt(3, 9), 0), (_prompt(4, 12), 5), (_prompt(5, 7), 6), (_prompt(6, 3), 2)]
    tables = [[0, 1, 2], [3, 4, 5, 6], [7, 8], [9]]
    kv_batch = _kv(tiny)
    kv_alone = _kv(tiny)
    prefix_items = []
    for (tokens, cut), table in zip(specs, tables, strict=True):
        prefix_items.append(ForwardItem(tokens[:cut], 0, table) if cut else None)
    for item in prefix_items:
        if item is not None:
            tiny.forward([item], kv_batch)
            tiny.forward([item], kv_alone)
    items = [
        ForwardItem(tokens[cut:], cut, table)
        for (tokens, cut), table in zip(specs, tables, strict=True)
    ]
    batched = tiny.forward(items, kv_batch)
    alone = np.concatenate([tiny.forward([item], kv_alone) for item in items])
    assert batched.shape == (4, 259)
    np.testing.assert_allclose(batched, alone, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(kv_batch, kv_alone, rtol=1e-10, atol=1e-12)


def test_forward_validates_inputs(tiny: Model) -> None:
    kv = _kv(tiny, 4)
    with pytest.raises(ValueError, match="cover"):
        tiny.forward([ForwardItem(_prompt(0, 9), 0, [0, 1])], kv)
    with pytest.raises(ValueError, match="dtype"):
        tiny.forward([ForwardItem(_prompt(0, 2), 0, [0])], kv.astype(np.float32))
    assert tiny.forward([], kv).shape == (0, 259)


def test_tiny_is_deterministic() -> None:
    a, b = Model.tiny(), Model.tiny()
    wa, wb = a.weights(), b.weights()
    assert wa.keys() == wb.keys()
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert not np.array_equal(Model.tiny(seed=1).weights()["lm_head.weight"], wa["lm_head.weight"])


def test_tiny_greedy_is_printable(tiny: Model) -> None:
    kv = _kv(tiny, 16)
    table = list(range(16))
    tokens = [256, *ByteTokenizer().encode("Hello")]
    logits = tiny.forward([ForwardItem(np.array(tokens), 0, table)], kv)
    out: list[int] = []
    for _ in range(40):
        token = int(np.argmax(logits[0]))
        out.append(token)
        pos = len(tokens) + len(out) - 1
        logits = tiny.forward([ForwardItem(np.array([token]), pos, table)], kv)
    assert all(t == 10 or 32 <= t <= 126 for t in out)
    assert np.std(logits[0][32:127]) > 1.0


def test_gqa_matches_repeated_kv_heads() -> None:
    """A GQA model equals the MHA model whose k/v heads are repeated HF-style (repeat_kv)."""
    gqa_cfg = ModelConfig(50, 32, 48, 2, num_heads=4, num_kv_heads=2, dtype="float64")
    mha_cfg = ModelConfig(50, 32, 48, 2, num_heads=4, num_kv_heads=4, dtype="float64")
    weights = init_weights(gqa_cfg, seed=7)
    mha_weights = dict(weights)
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            w = weights[name].reshape(2, 8, 32)  # (kv_heads, head_dim, d)
            mha_weights[name] = np.repeat(w, 2, axis=0).reshape(32, 32)
    gqa, mha = Model(gqa_cfg, weights), Model(mha_cfg, mha_weights)
    tokens = _prompt(8, 10) % 50
    out_gqa = gqa.forward([ForwardItem(tokens, 0, [0, 1, 2])], _kv(gqa, 4))
    out_mha = mha.forward([ForwardItem(tokens, 0, [0, 1, 2])], _kv(mha, 4))
    np.testing.assert_allclose(out_gqa, out_mha, rtol=1e-10, atol=1e-10)


def test_sample_greedy_and_topk() -> None:
    rng = np.random.default_rng(0)
    logits = np.array([0.5, 2.0, -1.0, 2.0, 1.0])
    token, logprob = sample(logits, 0.0, 1.0, 0, rng)
    assert token == 1
    expected = 2.0 - np.log(np.exp(logits).sum())
    assert logprob == pytest.approx(expected)
    for _ in range(10):
        assert sample(logits, 1.3, 1.0, 1, rng)[0] == 1
        assert sample(logits, 0.7, 1e-6, 0, rng)[0] == 1


def test_sample_seeded_and_logprob() -> None:
    logits = np.random.default_rng(1).standard_normal(300)
    draws_a = [sample(logits, 0.9, 0.9, 50, np.random.default_rng(5)) for _ in range(3)]
    rng_a, rng_b = np.random.default_rng(42), np.random.default_rng(42)
    seq_a = [sample(logits, 1.0, 0.95, 0, rng_a) for _ in range(50)]
    seq_b = [sample(logits, 1.0, 0.95, 0, rng_b) for _ in range(50)]
    assert seq_a == seq_b
    assert draws_a[0] == draws_a[1] == draws_a[2]
    assert len({t for t, _ in seq_a}) > 5
    log_z = np.log(np.exp(logits).sum())
    for token, logprob in seq_a:
        assert logprob <= 0.0
        assert logprob == pytest.approx(logits[token] - log_z)
    top50 = set(np.argsort(-logits)[:50].tolist())
    rng = np.random.default_rng(3)
    assert all(sample(logits, 2.0, 1.0, 50, rng)[0] in top50 for _ in range(50))


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo wörld — 你好 🎉\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode([tok.bos_id or 0, *ids, tok.eos_id or 0, 258]) == text
    assert tok.decode([0xFF]) == "\ufffd"


def test_incremental_detokenizer_multibyte() -> None:
    tok = ByteTokenizer()
    text = "a€b🎉"
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.feed(i) for i in tok.encode(text)]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert "€" in pieces and "🎉" in pieces
    assert all("\ufffd" not in p for p in pieces)
    trailing = IncrementalDetokenizer(tok)
    assert trailing.feed(0xE2) == "" and trailing.feed(0x82) == ""
    assert trailing.flush() == "\ufffd"


def test_render_chat() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "!"}],
        },
        {"role": "assistant", "content": None},
    ]
    assert render_chat(messages) == (
        "<|system|>\nBe brief.\n<|user|>\nHi !\n<|assistant|>\n\n<|assistant|>\n"
    )
    assert render_chat([]) == "<|assistant|>\n"
