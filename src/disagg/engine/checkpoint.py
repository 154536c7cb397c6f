"""Load and save local Hugging Face Llama-family checkpoints for the NumPy reference model.

Owns reading ``config.json``, ``*.safetensors`` (BF16 included) and ``tokenizer.json`` from a local
directory, and writing the same layout. It must not download anything or touch the network, and
it leaves the model math to ``model.py``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from disagg.engine.model import Array, Model, ModelConfig
from disagg.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["load_checkpoint", "model_from_name", "read_safetensors", "save_checkpoint"]

#: Non-standard ``config.json`` key written by ``save_checkpoint`` for byte-tokenizer models.
BYTE_TOKENIZER_KEY = "disagg_byte_tokenizer"

_NUMPY_DTYPES: dict[str, str] = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "BOOL": "?",
}


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The safetensors JSON header and the file offset where tensor data starts."""
    with path.open("rb") as f:
        raw_len = f.read(8)
        if len(raw_len) != 8:
            raise ValueError(f"{path.name}: not a safetensors file (too short)")
        (header_len,) = struct.unpack("<Q", raw_len)
        header = json.loads(f.read(header_len))
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + header_len


def _read_raw(path: Path) -> dict[str, Array]:
    """Parse a safetensors file by hand; BF16 becomes float32 (bf16 is the top half of f32)."""
    header, data_start = _read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, Array] = {}
    for name, info in header.items():
        begin, end = (data_start + int(o) for o in info["data_offsets"])
        shape = tuple(int(d) for d in info["shape"])
        dtype = str(info["dtype"])
        chunk = data[begin:end]
        if dtype == "BF16":
            bits = chunk.view("<u2").astype(np.uint32) << 16
            out[name] = bits.view(np.float32).reshape(shape)
        elif dtype in _NUMPY_DTYPES:
            out[name] = np.array(chunk.view(_NUMPY_DTYPES[dtype]).reshape(shape))
        else:
            raise ValueError(f"{path.name}: tensor {name!r} has unsupported dtype {dtype}")
    return out


def read_safetensors(path: str | Path) -> dict[str, Array]:
    """All tensors of one safetensors file as NumPy arrays (BF16 read as float32)."""
    path = Path(path)
    header, _ = _read_header(path)
    if any(info.get("dtype") == "BF16" for info in header.values()):
        return _read_raw(path)
    try:
        from safetensors.numpy import load_file
    except ImportError:  # optional dependency; the hand parser covers every dtype we use
        return _read_raw(path)
    return dict(load_file(str(path)))


def _config_from_json(raw: dict[str, Any], dtype: str) -> ModelConfig:
    def need(key: str) -> int:
        if key not in raw:
            raise ValueError(f"config.json is missing required key {key!r}")
        return int(raw[key])

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    if "head_dim" in raw and raw["head_dim"] is not None and int(raw["head_dim"]) * heads != hidden:
        raise ValueError(
            f"config.json head_dim {raw['head_dim']} != hidden_size / num_attention_heads;"
            " only Llama-style head_dim is supported"
        )
    return ModelConfig(
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        dtype=dtype,
        max_position=int(raw.get("max_position_embeddings", 4096)),
    )


def _load_weights(path: Path, tie: bool) -> dict[str, Array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors file in {path}")
    weights: dict[str, Array] = {}
    for file in files:
        weights.update(read_safetensors(file))
    biases = [k for k in weights if k.endswith("_proj.bias")]
    if biases:
        raise ValueError(f"projection biases are not supported (found {biases[0]!r})")
    if tie:
        # HF ignores a stored lm_head when embeddings are tied; so do we.
        weights.pop("lm_head.weight", None)
    return weights


def load_tokenizer(path: Path, raw: dict[str, Any]) -> Tokenizer:
    if raw.get(BYTE_TOKENIZER_KEY):
        return ByteTokenizer()
    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"tokenizer.json not found in {path}")

    def special(key: str) -> int | None:
        # config.json may list several eos ids (Llama 3.1); the first is the canonical one.
        value = raw.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        return int(value) if isinstance(value, int) else None

    return HFTokenizer(tok_path, bos_id=special("bos_token_id"), eos_id=special("eos_token_id"))


def load_checkpoint(path: str | Path, dtype: str = "float32") -> tuple[Model, Tokenizer]:
    """Load a local HF Llama-family directory; ``torch_dtype`` is ignored, math uses ``dtype``."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ValueError(f"config.json not found in {path}")
    raw = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    config = _config_from_json(raw, dtype)
    weights = _load_weights(path, bool(raw.get("tie_word_embeddings", False)))
    tokenizer = load_tokenizer(path, raw)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"tokenizer vocab_size {tokenizer.vocab_size} > model vocab_size {config.vocab_size}"
        )
    return Model(config, weights), tokenizer


def _write_safetensors(path: Path, tensors: dict[str, Array]) -> None:
    header: dict[str, Any] = {}
    offset = 0
    blobs: list[bytes] = []
    for name in sorted(tensors):
        blob = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(tensors[name].shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the format recommends 8-byte aligned data
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def save_checkpoint(model: Model, path: str | Path, byte_tokenizer: bool = True) -> None:
    """Write ``config.json`` and ``model.safetensors`` (float32) into directory ``path``.

    With ``byte_tokenizer`` the config marks the model as using ``ByteTokenizer`` so that
    ``load_checkpoint`` needs no ``tokenizer.json``; otherwise the caller provides one.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if byte_tokenizer:
        config[BYTE_TOKENIZER_KEY] = True
        config["bos_token_id"], config["eos_token_id"] = 256, 257
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    _write_safetensors(path / "model.safetensors", model.weights())


def model_from_name(name: str) -> tuple[Model, Tokenizer]:
    """``"tiny"`` is the built-in byte-level demo model; anything else is a checkpoint path."""
    if name == "tiny":
        return Model.tiny(), ByteTokenizer()
    return load_checkpoint(name)
