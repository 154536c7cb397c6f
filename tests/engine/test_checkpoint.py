"""Tests for loading/saving local HF-style checkpoints (tokenizer.json built in-memory)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from disagg.engine.checkpoint import (
    load_checkpoint,
    model_from_name,
    read_safetensors,
    save_checkpoint,
)
from disagg.engine.model import ForwardItem, Model, ModelConfig, init_weights
from disagg.engine.tokenizer import ByteTokenizer, HFTokenizer

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a paged cache holds keys and values",
    "prefill and decode run on different workers",
]
SMALL = ModelConfig(64, 32, 64, 2, num_heads=4, num_kv_heads=2, dtype="float32", max_position=64)


def _logits(model: Model, tokens: list[int]) -> np.ndarray:
    kv = np.zeros(model.kv_shape(8, 4), dtype=model.config.dtype)
    return model.forward([ForwardItem(np.array(tokens, dtype=np.int64), 0, list(range(8)))], kv)


def _write_tokenizer(path: Path) -> None:
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    trainer = tokenizers.trainers.WordLevelTrainer(
        vocab_size=SMALL.vocab_size, special_tokens=["<unk>", "<s>", "</s>"]
    )
    tok.train_from_iterator(SENTENCES, trainer)
    tok.save(str(path / "tokenizer.json"))


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _write_bf16_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name, value in tensors.items():
        blob = _bf16_bits(value).tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


def test_tiny_round_trip(tmp_path: Path) -> None:
    tiny = Model.tiny()
    save_checkpoint(tiny, tmp_path)
    loaded, tok = load_checkpoint(tmp_path)
    assert isinstance(tok, ByteTokenizer)
    assert loaded.config.dtype == "float32"
    assert loaded.config.vocab_size == tiny.config.vocab_size
    prompt = [256, *tok.encode("round trip")]
    np.testing.assert_allclose(_logits(loaded, prompt), _logits(tiny, prompt), rtol=1e-4, atol=1e-4)


def test_hf_tokenizer_checkpoint(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path)
    model = Model(SMALL, init_weights(SMALL, seed=3))
    save_checkpoint(model, tmp_path, byte_tokenizer=False)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    )
    loaded, tok = load_checkpoint(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size <= SMALL.vocab_size
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("the lazy fox")
    assert tok.decode(ids) == "the lazy fox"
    prompt = [tok.bos_id or 0, *ids]
    np.testing.assert_array_equal(_logits(loaded, prompt), _logits(model, prompt))


def test_bf16_safetensors_and_tied_embeddings(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path)
    weights = init_weights(SMALL, seed=4)
    del weights["lm_head.weight"]
    _write_bf16_safetensors(tmp_path / "model-00001-of-00001.safetensors", weights)
    save_checkpoint(Model(SMALL, weights), tmp_path / "tmp", byte_tokenizer=False)
    config = json.loads((tmp_path / "tmp" / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    read = read_safetensors(tmp_path / "model-00001-of-00001.safetensors")
    rounded = {
        k: (_bf16_bits(v).astype(np.uint32) << 16).view(np.float32) for k, v in weights.items()
    }
    assert read.keys() == rounded.keys()
    assert all(np.array_equal(read[k], rounded[k]) and read[k].dtype == np.float32 for k in read)
    loaded, _ = load_checkpoint(tmp_path)
    expected = Model(SMALL, rounded)
    np.testing.assert_array_equal(_logits(loaded, [1, 5, 9]), _logits(expected, [1, 5, 9]))


def test_missing_files_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    save_checkpoint(Model(SMALL, init_weights(SMALL)), tmp_path, byte_tokenizer=False)
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        load_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size"):
        load_checkpoint(tmp_path)


def test_missing_weight_raises(tmp_path: Path) -> None:
    weights = init_weights(SMALL)
    del weights["model.norm.weight"]
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        Model(SMALL, weights)


def test_model_from_name() -> None:
    model, tok = model_from_name("tiny")
    assert isinstance(tok, ByteTokenizer)
    assert model.config.vocab_size == tok.vocab_size == 259
