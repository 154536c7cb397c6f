"""NumPy Llama-style decoder (RMSNorm, HF rotate_half RoPE, GQA, SwiGLU) over a paged KV cache.

Owns the model math, the seeded tiny model and token sampling. It must not allocate or manage KV
blocks (the block manager does), do I/O, or keep per-sequence state between ``forward`` calls.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "ForwardItem",
    "Model",
    "ModelConfig",
    "init_weights",
    "sample",
    "weight_shapes",
]

Array = npt.NDArray[Any]


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dtype: str = "float32"
    max_position: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not np.issubdtype(np.dtype(self.dtype), np.floating):
            raise ValueError(f"ModelConfig.dtype must be a float dtype, got {self.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class ForwardItem:
    """The new tokens of one sequence in one forward step."""

    token_ids: Array
    start_pos: int
    block_table: Sequence[int]


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama weight names and shapes for ``config`` (``lm_head.weight`` included)."""
    d, hd = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, d)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (config.intermediate_size, d)
        shapes[p + "mlp.up_proj.weight"] = (config.intermediate_size, d)
        shapes[p + "mlp.down_proj.weight"] = (d, config.intermediate_size)
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (config.vocab_size, d)
    return shapes


def init_weights(config: ModelConfig, seed: int = 0) -> dict[str, Array]:
    """Seeded random weights for ``config`` that keep the residual stream near unit scale.

    Fan-in scaled projections keep every sublayer's output O(1); the output projections are
    shrunk by ``1/sqrt(2 * num_layers)`` so the sum over layers neither explodes nor drowns the
    embedding. Norm gains are jittered around 1 so tests exercise them.
    """
    rng = np.random.default_rng(seed)
    dtype = np.dtype(config.dtype)
    residual_scale = 1.0 / math.sqrt(2 * config.num_layers)
    out: dict[str, Array] = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                w *= residual_scale
        out[name] = w.astype(dtype)
    return out


@dataclass(frozen=True)
class _Layer:
    in_norm: Array
    w_qkv: Array  # (d, (H + 2 * KV) * hd), fused so one matmul produces q, k and v
    w_o: Array
    post_norm: Array
    w_gate_up: Array  # (d, 2 * I), fused gate and up projections
    w_down: Array


def _rms_norm(x: Array, weight: Array, eps: float) -> Array:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(var + eps) * weight  # type: ignore[no-any-return]


def _rope(x: Array, cos: Array, sin: Array) -> Array:
    """HF rotate_half RoPE: ``x * cat(c, c) + cat(-x2, x1) * cat(s, s)`` on (T, heads, hd)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _silu(x: Array) -> Array:
    # tanh form of the sigmoid: np.exp(-x) would overflow (and warn) for very negative x.
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


def _load_layers(config: ModelConfig, weights: Mapping[str, Array]) -> list[_Layer]:
    dtype = np.dtype(config.dtype)

    def t(name: str) -> Array:
        # (out, in) -> (in, out) once, so the hot path is a plain row-major x @ W.
        return np.ascontiguousarray(np.asarray(weights[name], dtype=dtype).T)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        w_qkv = np.concatenate(
            [t(attn + "q_proj.weight"), t(attn + "k_proj.weight"), t(attn + "v_proj.weight")],
            axis=1,
        )
        w_gate_up = np.concatenate([t(mlp + "gate_proj.weight"), t(mlp + "up_proj.weight")], axis=1)
        layers.append(
            _Layer(
                in_norm=np.asarray(weights[p + "input_layernorm.weight"], dtype=dtype),
                w_qkv=np.ascontiguousarray(w_qkv),
                w_o=t(attn + "o_proj.weight"),
                post_norm=np.asarray(weights[p + "post_attention_layernorm.weight"], dtype=dtype),
                w_gate_up=np.ascontiguousarray(w_gate_up),
                w_down=t(mlp + "down_proj.weight"),
            )
        )
    return layers


def _check_weights(config: ModelConfig, weights: Mapping[str, Array]) -> None:
    for name, shape in weight_shapes(config).items():
        if name not in weights:
            if name == "lm_head.weight":
                continue  # tied embeddings
            raise ValueError(f"missing weight {name!r}")
        got = tuple(np.shape(weights[name]))
        if got != shape:
            raise ValueError(f"weight {name!r} has shape {got}, expected {shape}")


class Model:
    """A Llama-style decoder; ``forward`` runs one batched step over a paged KV cache."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, Array]) -> None:
        _check_weights(config, weights)
        self.config = config
        self._dtype = np.dtype(config.dtype)
        self._embed = np.ascontiguousarray(weights["model.embed_tokens.weight"], dtype=self._dtype)
        head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        self._lm_head = np.ascontiguousarray(np.asarray(head, dtype=self._dtype).T)
        self._norm = np.asarray(weights["model.norm.weight"], dtype=self._dtype)
        self._layers = _load_layers(config, weights)
        self._cos, self._sin = self._rope_tables()
        self._scale = 1.0 / math.sqrt(config.head_dim)

    def _rope_tables(self) -> tuple[Array, Array]:
        # Half-width tables: HF's cat(freqs, freqs) duplicates them, _rope uses each half once.
        hd = self.config.head_dim
        inv_freq = 1.0 / (self.config.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        freqs = np.outer(np.arange(self.config.max_position, dtype=np.float64), inv_freq)
        return np.cos(freqs).astype(self._dtype), np.sin(freqs).astype(self._dtype)

    @classmethod
    def tiny(cls, seed: int = 0) -> Model:
        """The deterministic byte-level demo model (vocab 259: bytes, BOS, EOS, PAD)."""
        config = ModelConfig(
            vocab_size=259,
            hidden_size=256,
            intermediate_size=688,
            num_layers=4,
            num_heads=8,
            num_kv_heads=2,
            dtype="float64",
        )
        weights = init_weights(config, seed)
        head = weights["lm_head.weight"]
        # Only printable ASCII and newline can win greedily; their logits get a std of ~3.
        keep = np.zeros(config.vocab_size, dtype=bool)
        keep[32:127] = True
        keep[10] = True
        head[~keep] = 0.0
        head[keep] *= 3.0
        return cls(config, weights)

    def weights(self) -> dict[str, Array]:
        """The weights under their HF names (copies, in the model dtype), lm_head included."""
        out: dict[str, Array] = {
            "model.embed_tokens.weight": self._embed.copy(),
            "model.norm.weight": self._norm.copy(),
            "lm_head.weight": np.ascontiguousarray(self._lm_head.T),
        }
        qd, kd = self.config.num_heads * self.config.head_dim, self.config.num_kv_heads
        kd *= self.config.head_dim
        inter = self.config.intermediate_size
        for i, layer in enumerate(self._layers):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.in_norm.copy()
            out[p + "post_attention_layernorm.weight"] = layer.post_norm.copy()
            out[p + "self_attn.q_proj.weight"] = np.ascontiguousarray(layer.w_qkv[:, :qd].T)
            out[p + "self_attn.k_proj.weight"] = np.ascontiguousarray(
                layer.w_qkv[:, qd : qd + kd].T
            )
            out[p + "self_attn.v_proj.weight"] = np.ascontiguousarray(layer.w_qkv[:, qd + kd :].T)
            out[p + "self_attn.o_proj.weight"] = np.ascontiguousarray(layer.w_o.T)
            out[p + "mlp.gate_proj.weight"] = np.ascontiguousarray(layer.w_gate_up[:, :inter].T)
            out[p + "mlp.up_proj.weight"] = np.ascontiguousarray(layer.w_gate_up[:, inter:].T)
            out[p + "mlp.down_proj.weight"] = np.ascontiguousarray(layer.w_down.T)
        return out

    def kv_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        c = self.config
        return (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim)

    def forward(self, items: Sequence[ForwardItem], kv: Array) -> Array:
        """Run one step for ``items``; write their K/V into ``kv``; last-token logits per item.

        Projections and the MLP run once over all new tokens concatenated; attention runs per
        item, causally over the item's cached positions plus its new ones. Returns float64
        logits of shape ``(len(items), vocab_size)``.
        """
        self._check_kv(kv)
        if not items:
            return np.zeros((0, self.config.vocab_size), dtype=np.float64)
        ids, pos, blocks, offsets, tables = self._flatten(items, int(kv.shape[3]))
        cos, sin = self._cos[pos], self._sin[pos]
        eps = self.config.rms_norm_eps
        x = self._embed[ids]
        for li, layer in enumerate(self._layers):
            h = _rms_norm(x, layer.in_norm, eps)
            q = self._qkv_to_cache(h, layer, cos, sin, kv[li], blocks, offsets)
            attn = np.empty((len(ids), self.config.num_heads * self.config.head_dim), self._dtype)
            start = 0
            for item, table in zip(items, tables, strict=True):
                n = len(item.token_ids)
                attn[start : start + n] = self._attend(q[start : start + n], kv[li], item, table)
                start += n
            x = x + attn @ layer.w_o
            h = _rms_norm(x, layer.post_norm, eps)
            gate_up = h @ layer.w_gate_up
            inter = self.config.intermediate_size
            x = x + (_silu(gate_up[:, :inter]) * gate_up[:, inter:]) @ layer.w_down
        last = np.cumsum([len(it.token_ids) for it in items]) - 1
        h = _rms_norm(x[last], self._norm, eps)
        return np.asarray(h @ self._lm_head, dtype=np.float64)

    def _check_kv(self, kv: Array) -> None:
        c = self.config
        want = (c.num_layers, 2, c.num_kv_heads, c.head_dim)
        if kv.ndim != 6 or (kv.shape[0], kv.shape[1], kv.shape[4], kv.shape[5]) != want:
            raise ValueError(f"kv has shape {kv.shape}, expected {self.kv_shape(-1, -1)}-like")
        if kv.dtype != self._dtype:
            raise ValueError(f"kv dtype {kv.dtype} != model dtype {self._dtype}")

    def _flatten(
        self, items: Sequence[ForwardItem], block_size: int
    ) -> tuple[Array, Array, Array, Array, list[Array]]:
        """Concatenated token ids, positions and cache slots (block, offset) of all new tokens."""
        ids, pos, tables = [], [], []
        for item in items:
            tok = np.asarray(item.token_ids, dtype=np.int64).reshape(-1)
            n, start = len(tok), int(item.start_pos)
            if n < 1 or start < 0:
                raise ValueError(f"forward item needs >= 1 token and start_pos >= 0 (n={n})")
            if start + n > self.config.max_position:
                raise ValueError(f"position {start + n - 1} >= max_position")
            table = np.asarray(item.block_table, dtype=np.int64).reshape(-1)
            if len(table) * block_size < start + n:
                raise ValueError(
                    f"block_table of {len(table)} blocks of {block_size} does not cover "
                    f"{start + n} positions"
                )
            if tok.min() < 0 or tok.max() >= self.config.vocab_size:
                raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
            ids.append(tok)
            pos.append(np.arange(start, start + n, dtype=np.int64))
            tables.append(table)
        all_pos = np.concatenate(pos)
        slot_blocks = np.concatenate([t[p // block_size] for t, p in zip(tables, pos, strict=True)])
        return np.concatenate(ids), all_pos, slot_blocks, all_pos % block_size, tables

    def _qkv_to_cache(
        self,
        h: Array,
        layer: _Layer,
        cos: Array,
        sin: Array,
        kv_layer: Array,
        blocks: Array,
        offsets: Array,
    ) -> Array:
        """Project q/k/v, rotate q/k, store k/v at their cache slots; return rotated q."""
        c = self.config
        hd, qd, kd = c.head_dim, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = h @ layer.w_qkv
        q = _rope(qkv[:, :qd].reshape(-1, c.num_heads, hd), cos, sin)
        k = _rope(qkv[:, qd : qd + kd].reshape(-1, c.num_kv_heads, hd), cos, sin)
        kv_layer[0, blocks, offsets] = k
        kv_layer[1, blocks, offsets] = qkv[:, qd + kd :].reshape(-1, c.num_kv_heads, hd)
        return q

    def _attend(self, q: Array, kv_layer: Array, item: ForwardItem, table: Array) -> Array:
        """Causal GQA of one item's new queries (n, H, hd) over its cached positions."""
        c = self.config
        n, start = q.shape[0], int(item.start_pos)
        length = start + n
        block_size = kv_layer.shape[2]
        used = table[: -(-length // block_size)]
        # (blocks, B, KV, hd) -> (KV, 1, L, hd); the singleton broadcasts over each group.
        keys = kv_layer[0, used].reshape(-1, c.num_kv_heads, c.head_dim)[:length]
        vals = kv_layer[1, used].reshape(-1, c.num_kv_heads, c.head_dim)[:length]
        keys = keys.transpose(1, 0, 2)[:, None]
        vals = vals.transpose(1, 0, 2)[:, None]
        group = c.num_heads // c.num_kv_heads
        # HF repeat_kv maps query head h to kv head h // group, hence (n, KV, group, hd).
        qh = q.reshape(n, c.num_kv_heads, group, c.head_dim).transpose(1, 2, 0, 3)
        scores = (qh @ keys.transpose(0, 1, 3, 2)) * self._scale  # (KV, group, n, L)
        if n > 1:
            future = np.arange(length)[None, :] > np.arange(start, length)[:, None]
            scores[..., future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = scores @ vals  # (KV, group, n, hd)
        return np.asarray(out.transpose(2, 0, 1, 3).reshape(n, c.num_heads * c.head_dim))


def sample(
    logits: Array, temperature: float, top_p: float, top_k: int, rng: np.random.Generator
) -> tuple[int, float]:
    """Pick a token from 1-D ``logits``; return it with its log-prob under the plain softmax.

    ``temperature == 0`` is greedy (ties go to the lowest id); ``top_k <= 0`` and ``top_p == 1``
    disable those filters. The reported log-prob ignores temperature and filtering so that it
    describes the model, not the sampler.
    """
    if temperature < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    peak = float(x.max())
    log_z = peak + math.log(float(np.exp(x - peak).sum()))
    if temperature == 0:
        token = int(np.argmax(x))
        return token, float(x[token] - log_z)
    scaled = x / temperature
    if 0 < top_k < len(x) or top_p < 1.0:
        # Stable descending order so that, like argmax, ties prefer the lower id.
        cand = np.argsort(-scaled, kind="stable")
        if 0 < top_k < len(x):
            cand = cand[:top_k]
    else:
        cand = np.arange(len(x))
    probs = np.exp(scaled[cand] - scaled[cand].max())
    cdf = np.cumsum(probs)
    if top_p < 1.0:
        # Smallest prefix whose mass reaches top_p (always at least the top token).
        keep = min(int(np.searchsorted(cdf, top_p * cdf[-1])) + 1, len(cdf))
        cand, cdf = cand[:keep], cdf[:keep]
    idx = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cand) - 1)
    token = int(cand[idx])
    return token, float(x[token] - log_z)
