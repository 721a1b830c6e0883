"""Rotary position embedding, neox style (rotate halves), as Hugging Face Llama.

The inverse frequencies follow ``transformers.modeling_rope_utils`` exactly for the
rope types below; cos/sin are precomputed in float32 for every position up to
``max_position_embeddings``, or ``max_model_len`` where that is longer (``cover``), and
cast to the query dtype when applied.

Two rope types make the frequencies depend on the sequence's length, past an original
context (``LengthScaledRotaryEmbedding``): ``dynamic`` (NTK: the base grows with the
length past ``max_position_embeddings``) and ``longrope`` (Phi-3's: the long factors
past ``original_max_position_embeddings``). transformers recomputes them at each
forward from that forward's last position, so in its ``generate`` (KV cache on) a
prompt's tokens all turn at the prompt's length and each generated token at its own
position + 1; the keys already cached keep the frequencies they were computed with.
loom gives every token the same: its request's ``max(prompt length, position + 1)``
(``AttentionMetadata.rope_lengths``, from the model runner), whatever the chunking,
batching or preemption, which is what transformers gives each request alone.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from loom.kernels import native_ops, native_ops_for
from loom.model.attention.metadata import get_forward_context


class RopeStep(NamedTuple):
    """One step's rotary inputs: ``cos``/``sin`` are None on the native path."""
    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


def rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings of ``config`` as one dict with ``rope_type`` and ``rope_theta``.

    transformers 5.x keeps them in ``config.rope_parameters``; older configs use
    ``rope_scaling`` (with ``type`` or ``rope_type``) plus ``rope_theta``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # as transformers' standardize_rope_params: the config's own field first (Phi-3)
        original = getattr(config, "original_max_position_embeddings", None)
        if original is not None:
            params["original_max_position_embeddings"] = original
        params.setdefault("original_max_position_embeddings",
                          getattr(config, "max_position_embeddings", None))
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the middle interpolated
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_inv_freq(base: float, dim: int, params: dict[str, Any],
                   max_position: int) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original_max = params.get("original_max_position_embeddings", max_position)
    if factor is None:
        factor = max_position / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) \
        + (1.0 / pos_freqs) * extrapolation_factor
    return inv_freq, attention_factor


def _dynamic_base(params: dict[str, Any], max_position: int, rotary_dim: int,
                  seq_len: Any) -> Any:
    """Dynamic NTK's base at ``seq_len`` (at least ``max_position``), as transformers'
    ``_compute_dynamic_ntk_parameters``: Python floats for a number (the frequencies it
    starts with), float32 for a 0-dim int64 tensor (what each forward past
    ``max_position`` recomputes them from)."""
    factor = params["factor"]
    return params["rope_theta"] * ((factor * seq_len / max_position) - (factor - 1)) \
        ** (rotary_dim / (rotary_dim - 2))


def _longrope_inv_freq(base: float, dim: int, factors: list[float],
                       device: torch.device | None = None) -> torch.Tensor:
    ext_factors = torch.tensor(factors, dtype=torch.float32, device=device)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (ext_factors * base ** exponents)


def _longrope_attention_factor(params: dict[str, Any], max_position: int) -> float:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position / original
    if params.get("attention_factor") is not None:
        return params["attention_factor"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def compute_inv_freq(config: Any, head_dim: int) -> tuple[torch.Tensor, float, int]:
    """``(inv_freq, attention_scaling, rotary_dim)`` for ``config``'s rope type; for
    ``dynamic`` and ``longrope``, those within the original context."""
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    rotary_dim = int(head_dim * params.get("partial_rotary_factor",
                                           getattr(config, "partial_rotary_factor", 1.0)))
    max_position = config.max_position_embeddings
    attention_scaling = 1.0
    if rope_type == "default":
        inv_freq = _default_inv_freq(base, rotary_dim)
    elif rope_type == "dynamic":
        # the base at max_position_embeddings (1.0 x rope_theta, up to rounding)
        inv_freq = _default_inv_freq(_dynamic_base(params, max_position, rotary_dim,
                                                   max_position), rotary_dim)
    elif rope_type == "longrope":
        inv_freq = _longrope_inv_freq(base, rotary_dim, params["short_factor"])
        attention_scaling = _longrope_attention_factor(params, max_position)
    elif rope_type == "linear":
        inv_freq = _default_inv_freq(base, rotary_dim) / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(_default_inv_freq(base, rotary_dim), params)
    elif rope_type == "yarn":
        inv_freq, attention_scaling = _yarn_inv_freq(base, rotary_dim, params, max_position)
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: default, "
                         "linear, dynamic, llama3, yarn, longrope")
    return inv_freq, attention_scaling, rotary_dim


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding: with ``x = [x1 | x2]`` (halves of the first
    ``rotary_dim`` dims) and per-position ``c = cos``, ``s = sin`` of each frequency,

        out = [x1 * c - x2 * s | x2 * c + x1 * s]

    which is Hugging Face's ``x * cos + rotate_half(x) * sin`` bit for bit (its cos and
    sin repeat the frequencies twice; negating a product is exact). One model shares
    one instance across its layers; ``cos_sin`` is computed once per step."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.attention_scaling = attention_scaling
        # A float32 buffer not in the state dict; _apply below keeps it float32.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.register_buffer("cos_sin_cache", self._cos_sin_rows(max_position),
                             persistent=False)  # (2, P, rotary_dim / 2)

    def _cos_sin_rows(self, num_positions: int) -> torch.Tensor:
        positions = torch.arange(num_positions, dtype=torch.float32,
                                 device=self.inv_freq.device)
        freqs = positions[:, None] * self.inv_freq[None, :]  # (P, rotary_dim / 2)
        return torch.stack((freqs.cos() * self.attention_scaling,
                            freqs.sin() * self.attention_scaling))

    def cover(self, max_length: int) -> None:
        """Make the cache hold every position below ``max_length`` (the engine's
        max_model_len, which rope scaling lets exceed max_position_embeddings). Called
        once the model is built, before any forward is recorded or captured."""
        if max_length > self.cos_sin_cache.shape[1]:
            self.cos_sin_cache = self._cos_sin_rows(max_length)

    def _apply(self, fn, recurse=True):
        # Follow device moves but never a dtype cast: cos/sin stay float32.
        super()._apply(fn, recurse)
        for name in ("inv_freq", "cos_sin_cache"):
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, getattr(self, name).float())
        return self

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` (T,), each (T, 1, rotary_dim / 2) in ``dtype``."""
        cos_sin = self.cos_sin_cache[:, positions].to(dtype)  # (2, T, rotary_dim / 2)
        return cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (T, N, head_dim), which may be a strided view; returns a new
        contiguous tensor."""
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half:self.rotary_dim]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out1, out2 = out[..., :half], out[..., half:self.rotary_dim]
        torch.mul(x1, cos, out=out1)
        out1.sub_(x2 * sin)
        torch.mul(x2, cos, out=out2)
        out2.add_(x1 * sin)
        if self.rotary_dim < self.head_dim:
            out[..., self.rotary_dim:] = x[..., self.rotary_dim:]
        return out

    def step_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        """What ``rotate`` needs for one step's ``positions`` (T,), built once per step
        and shared by the layers: the positions for the native kernel (CPU, float32 or
        bfloat16), or cos and sin gathered for the PyTorch path."""
        if native_ops_for(positions.device, dtype) is not None:
            return RopeStep(positions.long(), None, None)
        return RopeStep(positions, *self.cos_sin(positions, dtype))

    def rotate(self, x: torch.Tensor, step: RopeStep) -> torch.Tensor:
        """``x`` (T, N, head_dim) rotated; in place on the native path, where ``x`` may
        be a strided view (of the fused qkv output, say) and is returned."""
        if step.cos is None:
            native_ops().rotary_embedding(x, step.positions, self.cos_sin_cache)
            return x
        return self.apply(x, step.cos, step.sin)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rope (Qwen2-VL's M-RoPE): each token has three positions, temporal,
    height and width, and each frequency turns by one of them: ``mrope_section`` splits
    the ``rotary_dim / 2`` frequencies into three runs (t, h, w), or, with
    ``mrope_interleaved`` (Qwen3-VL), deals them out: h at frequencies 1, 4, 7, ... below
    ``3 * section[1]``, w at 2, 5, 8, ... below ``3 * section[2]``, t at the others.

    A text token's three positions are equal, which makes this the plain rope at that
    position: a step whose positions are (T,) runs as ``RotaryEmbedding`` (the native
    kernel on the CPU), one with (3, T) positions (image tokens in it) gathers each
    frequency's cos and sin at its own axis's position."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 inv_freq: torch.Tensor, attention_scaling: float, section: list[int],
                 interleaved: bool = False) -> None:
        super().__init__(head_dim, rotary_dim, max_position, inv_freq, attention_scaling)
        half = rotary_dim // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must add up to rotary_dim / 2 = {half}")
        if interleaved:
            axis = [0] * half
            for which in (1, 2):  # (cut at the last frequency, as transformers does)
                for j in range(which, min(3 * section[which], half), 3):
                    axis[j] = which
        else:
            axis = [which for which, size in enumerate(section) for _ in range(size)]
        self.register_buffer("axis_of_freq", torch.tensor(axis, dtype=torch.long),
                             persistent=False)

    def step_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        if positions.dim() == 1:
            return super().step_inputs(positions, dtype)
        # (3, T) -> each frequency's position (T, F) -> cos and sin (2, T, F)
        per_freq = positions[self.axis_of_freq].t()
        freqs = torch.arange(per_freq.shape[1], device=positions.device)
        cos_sin = self.cos_sin_cache[:, per_freq, freqs].to(dtype)
        return RopeStep(positions[0], cos_sin[0].unsqueeze(1), cos_sin[1].unsqueeze(1))


class LengthScaledRotaryEmbedding(RotaryEmbedding):
    """A rope whose frequencies depend on the sequence's length past ``scales_past``
    tokens (``dynamic``: ``max_position_embeddings``; ``longrope``: the original
    context). Within it, it is the plain rope (its cache, the native kernel, replays and
    CUDA graphs as usual). A step where some token's length, ``max(prompt length,
    position + 1)`` (module doc), is past it carries those lengths
    (``AttentionMetadata.rope_lengths``); each token then turns at its own length's
    frequencies, computed as transformers computes them (float32, on the cache's device,
    the same ops) and kept per length. Such steps run eagerly: the runner's replay and
    CUDA graphs pass them by. A forward without the lengths (no forward context, a draft
    model's own proposals) turns every token at the original context's frequencies."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 inv_freq: torch.Tensor, attention_scaling: float,
                 params: dict[str, Any]) -> None:
        """``max_position``: the config's max_position_embeddings; ``params``: its
        ``rope_parameters`` (``rope_parameters()``)."""
        super().__init__(head_dim, rotary_dim, max_position, inv_freq, attention_scaling)
        self.rope_type = params["rope_type"]
        self.params = params
        self.max_position_embeddings = max_position
        self.scales_past = (max_position if self.rope_type == "dynamic"
                            else params["original_max_position_embeddings"])
        self._inv_freq_by_length: dict[int, torch.Tensor] = {}

    def inv_freq_at(self, length: int) -> torch.Tensor:
        """The frequencies transformers turns a forward's tokens by when its last position
        is ``length - 1``: (rotary_dim / 2,) float32."""
        if length <= self.scales_past:
            return self.inv_freq
        inv_freq = self._inv_freq_by_length.get(length)
        if inv_freq is None:
            device = self.inv_freq.device
            if self.rope_type == "longrope":  # the long factors, for every length past
                inv_freq = _longrope_inv_freq(self.params["rope_theta"], self.rotary_dim,
                                              self.params["long_factor"], device)
            else:  # dynamic NTK: the base at this length, from a 0-dim int64 as transformers
                base = _dynamic_base(self.params, self.max_position_embeddings,
                                     self.rotary_dim, torch.tensor(length, device=device))
                inv_freq = 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2,
                                                        dtype=torch.int64,
                                                        device=device).float()
                                           / self.rotary_dim))
            if len(self._inv_freq_by_length) >= 4096:
                self._inv_freq_by_length.clear()
            self._inv_freq_by_length[length] = inv_freq
        return inv_freq

    def step_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        lengths = current_rope_lengths()
        if lengths is None:
            return super().step_inputs(positions, dtype)
        if lengths.shape != positions.shape:
            raise ValueError(f"rope_lengths {tuple(lengths.shape)} do not match the step's "
                             f"positions {tuple(positions.shape)}")
        # each token's frequencies: one row per distinct length in the step
        distinct, row_of_token = torch.unique(lengths, return_inverse=True)
        rows = torch.stack([self.inv_freq_at(length) for length in distinct.tolist()])
        freqs = positions[:, None].float() * rows[row_of_token]  # (T, rotary_dim / 2)
        cos = (freqs.cos() * self.attention_scaling).to(dtype)
        sin = (freqs.sin() * self.attention_scaling).to(dtype)
        return RopeStep(positions, cos.unsqueeze(1), sin.unsqueeze(1))


def current_rope_lengths() -> torch.Tensor | None:
    """The step's per-token sequence lengths for length-scaled ropes, if it has them."""
    try:
        return get_forward_context().rope_lengths
    except RuntimeError:  # a forward outside the runner's (a test's, say)
        return None


def get_rope(config: Any, head_dim: int) -> RotaryEmbedding:
    inv_freq, attention_scaling, rotary_dim = compute_inv_freq(config, head_dim)
    params = rope_parameters(config)
    section = params.get("mrope_section")
    if params["rope_type"] in ("dynamic", "longrope"):
        if section:
            raise ValueError(f"rope_type {params['rope_type']!r} with mrope_section (a "
                             "multimodal rope) is not supported")
        return LengthScaledRotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings,
                                           inv_freq, attention_scaling, params)
    if section:
        return MRotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings,
                                inv_freq, attention_scaling, list(section),
                                bool(params.get("mrope_interleaved")))
    return RotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings,
                           inv_freq, attention_scaling)
