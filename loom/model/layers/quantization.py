"""Weight-only quantization of the decoder's linear layers.

``--quantization`` (``ModelConfig.quantization``) names it:

- ``auto``: a checkpoint runs as stored; a GGUF file keeps its Q8_0, Q4_0, Q4_1, Q5_0,
  Q4_K, Q5_K and Q6_K linear weights quantized (other GGUF formats are dequantized, with a
  log line).
- ``none``: every weight dequantized to the model's dtype (a GGUF file too).
- ``wint8``: per-output-channel symmetric int8 made at load from the loaded weights.
- ``wint4``: group-wise asymmetric 4-bit (``group_size`` input features per scale and
  offset, 128 by default) made at load.

Every one of these is held as a ``QuantizedTensor``: ``bits``-wide unsigned values q in
groups of input features, each group of each output row with a scale d and either an
offset m (asymmetric) or the fixed zero point z = 2^(bits-1) (symmetric)::

    w = d * (q - z)      symmetric:  Q8_0 (8-bit, float16 d per 32), Q4_0 (4-bit, per 32),
                                     Q5_0 (5-bit, float16 d per 32),
                                     wint8 (8-bit, one float32 d per row),
                                     Q6_K (6-bit, two-level d per 16)
    w = d * q + m        asymmetric: Q4_1 (4-bit, float16 d and m per 32), wint4,
                                     Q4_K (4-bit, two-level d and m per 32),
                                     Q5_K (5-bit, two-level d and m per 32)

The K-quants keep their two-level scales as the file has them: an int8 per group (Q4_K
and Q5_K's 6-bit scale and min, Q6_K's signed 8-bit scale) times a float16 per
super-block of 256 values (d, and -dmin for the offsets). Where they apply (the
kernel's float32 per-group scaling, ``dequantize``) the two are multiplied in float32:
exact, since both factors fit in float32's 24-bit significand, and what ``gguf.quants``
computes before it scales the values. So loom's kernel layout holds each format at its
file's size, bits per weight (file -> held)::

    Q4_0 4.5 -> 4.5     Q4_1 5.0 -> 5.0     Q5_0 5.5 -> 5.5     Q8_0 8.5 -> 8.5
    Q4_K 4.5 -> 4.625   Q5_K 5.5 -> 5.625   Q6_K 6.5625 -> 6.5625

(Q4_K and Q5_K: the file packs 8 six-bit scales and mins in 12 bytes per 256 values,
loom an int8 each. Before, with the two levels multiplied out into float32 and 5- and
6-bit values held in 8 bits: Q4_K 6, Q5_K 10, Q6_K 10, Q5_0 8.5.) A ``QuantizedTensor``
holds one byte per value while a layer loads (its staging), and the PyTorch path keeps
its values bit-packed (``held``: Q4_0 4.5, Q6_K 6.5625, as the kernel's layout). Either way
the values and scales are the file's (``loom/kernels/csrc/quant_gemm.cpp`` repacks them
into panels), so a GGUF block is repacked, never re-quantized: the dequantized weights equal llama.cpp's
(``gguf.quants``) bit for bit. Quantizing at load (wint8, wint4) happens in the weight
loader on the whole checkpoint tensor, before a rank takes its shard: a row's scale
comes from the full row, and tensor parallel ranks hold exactly TP=1's values wherever
wint4's group divides each rank's shard (else the group halves until it does, logged:
``fitting_group_size``). A file's block that a tensor-parallel row split would cut (a
K-quant's 256-feature super-block over ranks of 2,432 features: Qwen2.5-0.5B's MLP at
TP=2) makes that layer full precision, logged.

Two ways to multiply: loom's kernel (bfloat16 models on AVX512-BF16 CPUs: the values
unpacked in registers to exact bf16 integers, vdpbf16ps, the scale and offset applied
per group in float32; on AVX2 CPUs the same sums in float32 vectors; no activation is
quantized, so it equals the reference up to float32 rounding) and the PyTorch reference (``reference_linear``: dequantize to
float32, then matmul), which float32 models, other CPUs and CUDA run: correct, not fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loom.config import check_quantization_name

INT8_MAX = 127
WINT4_GROUP_SIZE = 128
KERNEL_BLOCK = 32  # the 4-bit kernel's block of input features (8-bit groups may be 16: Q6_K)

SUPER_BLOCK = 256  # values per K-quant block: their super scales'


def table_quantization(name: str, lm_head_fp32: bool = False) -> str | None:
    """What becomes of a full-precision embedding table and LM head under
    ``--quantization name``: ``wint8`` (per vocabulary row, symmetric: a row is both an
    embedding and an output channel) under wint8 and wint4, as llama.cpp keeps its output
    tensor at 6 bits or more under its 4-bit types; None (kept as stored) otherwise, and
    with ``--lm-head-fp32``, whose head multiplies in float32 from the table as loaded."""
    check_quantization_name(name)
    return "wint8" if name in ("wint8", "wint4") and not lm_head_fp32 else None


def linear_weight_quantization(name: str, group_size: int = WINT4_GROUP_SIZE) -> str:
    """What the decoder's linear layers do with full-precision weights under
    ``--quantization name``, as ``LinearBase(quantization=...)`` takes it: ``none`` (keep
    them), ``wint8``, or ``wint4:<group size>`` (``parse_weight_quantization``)."""
    check_quantization_name(name)
    if name == "wint4":
        return f"wint4:{group_size}"
    return "none" if name == "auto" else name


def parse_weight_quantization(value: str) -> tuple[str, int]:
    """``wint4:64`` -> (wint4, 64); ``wint8`` -> (wint8, 128): a layer's method and wint4
    group size."""
    method, _, group = value.partition(":")
    if method not in ("none", "wint8", "wint4") or (group and not group.isdigit()):
        raise ValueError(f"linear layers hold none, wint8 or wint4[:group] weights, not "
                         f"{value!r}")
    return method, int(group) if group else WINT4_GROUP_SIZE


@dataclass
class QuantizedTensor:
    """A (N, K) weight as ``bits``-wide values (uint8 (N, K), one byte per value) with a
    scale per group of input features (``scales`` (N, groups), float16 or float32) and
    an offset per group if asymmetric (``offsets``, same shape), else the zero point
    2^(bits-1). ``format`` names it for logs (Q4_1, wint8, ...).

    Two-level (the K-quants, ``super_scales`` set): ``scales`` (and ``offsets``) are int8
    integers per group and ``super_scales`` (and ``super_offsets``) float16 factors per
    super-block of 256 input features, (N, K / 256): the group's scale is
    ``super_scale * scale`` and its offset ``super_offset * offset``, each product exact
    in float32 (the K-quants' dmin is held negated, so that offsets add as everywhere).

    Shaped like the tensors a weight loader takes: ``shape``, ``dim()``, ``narrow``
    (rows freely, input features at group boundaries (super-block ones if two-level),
    or anywhere with one group per row: its scale holds for every part of the row) and
    ``copy_``."""

    values: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    bits: int
    format: str
    super_scales: torch.Tensor | None = None
    super_offsets: torch.Tensor | None = None
    # values bit-packed, (N, K * bits / 8) (``held``): how the PyTorch path keeps them
    packed: bool = False

    @property
    def shape(self) -> torch.Size:
        if self.packed:
            return torch.Size((self.values.shape[0], self.values.shape[1] * 8 // self.bits))
        return self.values.shape

    def dim(self) -> int:
        return 2

    @property
    def group_size(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def splits_into(self, in_features: int) -> bool:
        """Whether a shard of ``in_features`` input features (a tensor-parallel rank's, at
        a multiple of it) holds whole groups, and whole super-blocks if two-level."""
        if self.scales.shape[1] == 1:
            return True
        return in_features % self.group_size == 0 and not (
            self.two_level and in_features % SUPER_BLOCK)

    def held(self) -> QuantizedTensor:
        """This weight with its values bit-packed (``pack_bits``): what the PyTorch path
        keeps resident, at the format's own bits per value."""
        if self.packed:
            return self
        return dataclasses.replace(self, values=pack_bits(self.values, self.bits), packed=True)

    def expanded(self) -> QuantizedTensor:
        """This weight with a byte per value (values unpacked if ``held``; else itself)."""
        if not self.packed:
            return self
        return dataclasses.replace(self, values=unpack_bits(self.values, self.bits),
                                   packed=False)

    @property
    def zero_point(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def two_level(self) -> bool:
        return self.super_scales is not None

    def tensors(self) -> list[torch.Tensor]:
        """What holds it: values, scales, then offsets, super_scales and super_offsets
        where present (``with_tensors`` takes them back in this order)."""
        return [t for t in (self.values, self.scales, self.offsets, self.super_scales,
                             self.super_offsets) if t is not None]

    def to(self, device: torch.device) -> QuantizedTensor:
        """This weight on ``device`` (itself when it is there)."""
        if self.values.device == device:
            return self
        return self.with_tensors([t.to(device) for t in self.tensors()])

    def with_tensors(self, tensors: list[torch.Tensor]) -> QuantizedTensor:
        """This layout over other tensors (``tensors()``'s order): views, copies."""
        held = iter(tensors)
        return QuantizedTensor(next(held), next(held),
                               None if self.offsets is None else next(held), self.bits,
                               self.format, None if self.super_scales is None else next(held),
                               None if self.super_offsets is None else next(held),
                               self.packed)

    def _map(self, fn) -> QuantizedTensor:
        """``fn`` applied to every tensor (row selections, copies)."""
        return self.with_tensors([fn(t) for t in self.tensors()])

    def same_layout(self, other: QuantizedTensor) -> bool:
        """Whether ``other`` can be copied into this one (shape aside)."""
        return (self.bits == other.bits and (self.offsets is None) == (other.offsets is None)
                and self.packed == other.packed
                and self.two_level == other.two_level
                and self.scales.dtype == other.scales.dtype
                and (self.scales.shape[1] == 1) == (other.scales.shape[1] == 1)
                and (self.scales.shape[1] == 1 or self.group_size == other.group_size))

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        if dim == 0:
            return self._map(lambda t: t.narrow(0, start, length))
        if self.packed:
            return self.expanded().narrow(dim, start, length)
        if self.scales.shape[1] == 1:  # one scale per row
            return QuantizedTensor(self.values.narrow(1, start, length), self.scales,
                                   self.offsets, self.bits, self.format)
        group = self.group_size
        if self.two_level and (start % SUPER_BLOCK or length % SUPER_BLOCK):
            raise ValueError(f"a {self.format} weight splits its input features only at "
                             f"multiples of its {SUPER_BLOCK}-feature super-blocks, not at "
                             f"{start}:{start + length} (a tensor-parallel row split "
                             f"too: choose a tensor-parallel size that divides the input "
                             f"features in whole super-blocks)")
        if start % group or length % group:
            raise ValueError(f"a {self.format} weight splits at multiples of its group of "
                             f"{group} input features, not at {start}:{start + length}")

        def columns(t: torch.Tensor) -> torch.Tensor:
            per_column = self.values.shape[1] // t.shape[1]  # features per column of t
            return t.narrow(1, start // per_column, length // per_column)
        return self._map(columns)

    def copy_(self, src: QuantizedTensor) -> QuantizedTensor:
        if not self.same_layout(src):
            raise ValueError(f"cannot copy a {src.format} weight into a {self.format} one")
        for dst, tensor in zip(self.tensors(), src.tensors()):
            dst.copy_(tensor)
        return self

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows ``index`` (a permutation, e.g. GGUF's q/k order undone)."""
        return self._map(lambda t: t[index])

    def clone(self) -> QuantizedTensor:
        """A copy that owns its memory (a row block cut from a larger weight)."""
        return self._map(torch.Tensor.clone)

    @classmethod
    def cat(cls, blocks: list[QuantizedTensor]) -> QuantizedTensor:
        """Row blocks of one layout (``same_layout``) stacked top to bottom."""
        if len(blocks) == 1:
            return blocks[0]
        first = blocks[0]
        if not all(first.same_layout(block) for block in blocks[1:]):
            raise ValueError("only row blocks of one layout stack into one weight")
        return first.with_tensors([torch.cat(parts) for parts in
                                   zip(*(block.tensors() for block in blocks))])

    @classmethod
    def empty(cls, like: QuantizedTensor, shape: tuple[int, int],
              device: torch.device | None = None) -> QuantizedTensor:
        """Zeros of ``like``'s layout in ``shape`` (a layer's shard of it), on ``device``
        (default: ``like``'s)."""
        n, k = shape
        groups = 1 if like.scales.shape[1] == 1 else k // like.group_size
        if groups != 1 and k % like.group_size or like.two_level and k % SUPER_BLOCK:
            raise ValueError(f"{k} input features are not whole groups of "
                             f"{like.group_size} ({like.format}"
                             f"{f' in super-blocks of {SUPER_BLOCK}' if like.two_level else ''})")
        widths = [k, groups, groups, k // SUPER_BLOCK, k // SUPER_BLOCK]
        present = [like.values, like.scales, like.offsets, like.super_scales,
                   like.super_offsets]
        return dataclasses.replace(
            like.with_tensors([torch.zeros(n, width, dtype=t.dtype,
                                           device=like.values.device if device is None
                                           else device)
                               for width, t in zip(widths, present) if t is not None]),
            packed=False)

    def scales_and_offsets(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each group's d and m (None if symmetric) in float32, (N, groups): two-level
        ones multiplied out (exact, as ``gguf.quants`` computes them)."""
        d = self.scales.float()
        m = None if self.offsets is None else self.offsets.float()
        if self.two_level:
            per_super = SUPER_BLOCK // self.group_size
            d = self.super_scales.float().repeat_interleave(per_super, dim=1) * d
            if m is not None:
                m = self.super_offsets.float().repeat_interleave(per_super, dim=1) * m
        return d, m

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(N, K) weights computed in float32 (``d * (q - z)`` or ``d * q + m``, each
        operation rounded once, as ``gguf.quants`` does) and rounded once to ``dtype``."""
        n, k = self.shape
        groups = self.scales.shape[1]
        d, m = self.scales_and_offsets()
        # (N, groups, group) values against (N, groups, 1) scales: the same elementwise
        # operations as on (N, K) copies of the scales, without materializing them
        q = self.expanded().values.float().view(n, groups, k // groups)
        if m is None:
            w = (q - self.zero_point) * d.unsqueeze(2)
        else:
            w = q * d.unsqueeze(2) + m.unsqueeze(2)
        return w.view(n, k).to(dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def pack(self, ops):
        """Packed for loom's kernel (``ops``: ``native_ops()``): a ``QuantizedWeight``."""
        return ops.pack_quantized_weight(self.expanded().values, self.scales, self.offsets,
                                         self.bits, self.super_scales, self.super_offsets)

    @classmethod
    def unpack(cls, ops, weight, format: str) -> QuantizedTensor:
        """A kernel's ``QuantizedWeight`` back as a ``QuantizedTensor`` (a copy)."""
        values, scales, offsets, super_scales, super_offsets = \
            ops.unpack_quantized_weight(weight)
        return cls(values, scales, offsets, weight.bits, format, super_scales, super_offsets)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(N, K) ``bits``-wide values, a byte each, as (N, K * bits / 8) bytes: 8-bit as
    they are; narrower ones as their low nibbles two to a byte (value 2j in byte j's low
    half, 2j + 1 in its high half), then, for 5 and 6 bits, the bits above as a plane
    (bits 4 and 5 of value (8 / (bits - 4)) j + i in bits (bits - 4) i .. of byte j).
    Plain tensor operations, so any device packs its own (K a multiple of 8)."""
    if bits == 8:
        return values
    n, k = values.shape
    low = values & 0x0F
    parts = [low[:, 0::2] | (low[:, 1::2] << 4)]
    if bits > 4:
        width = bits - 4
        per_byte = 8 // width
        high = (values >> 4).view(n, k // per_byte, per_byte)
        plane = torch.zeros(n, k // per_byte, dtype=torch.uint8, device=values.device)
        for i in range(per_byte):
            plane |= high[:, :, i] << (width * i)
        parts.append(plane)
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``pack_bits`` undone: (N, K) values, a byte each."""
    if bits == 8:
        return packed
    n = packed.shape[0]
    k = packed.shape[1] * 8 // bits
    nibbles = packed[:, :k // 2]
    values = torch.stack((nibbles & 0x0F, nibbles >> 4), dim=2).view(n, k)
    if bits > 4:
        width = bits - 4
        plane = packed[:, k // 2:]
        shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
        high = (plane.unsqueeze(2) >> shifts) & ((1 << width) - 1)
        values = values | (high.view(n, k) << 4)
    return values


def quantize(weight: torch.Tensor, method: str, group_size: int = WINT4_GROUP_SIZE
             ) -> QuantizedTensor:
    """A full-precision (N, K) weight quantized by ``method`` (wint8 or wint4)."""
    if method == "wint8":
        return quantize_wint8(weight)
    if method == "wint4":
        return quantize_wint4(weight, group_size)
    raise ValueError(f"no quantization method {method!r}")


def quantize_wint8(weight: torch.Tensor) -> QuantizedTensor:
    """Per output row, symmetric::

        scale[n] = max_k |W[n, k]| / 127   (float32; a zero row gets scale 1)
        q[n, k]  = round(W[n, k] / scale[n]) in [-127, 127], held as q + 128
    """
    weight = weight.detach()
    n, k = weight.shape
    values = torch.empty(n, k, dtype=torch.uint8, device=weight.device)
    scales = torch.empty(n, 1, dtype=torch.float32, device=weight.device)
    # 16 MB of float32 rows at a time (a 1B model's tied table is 0.4 GB of them)
    step = max(1, (1 << 22) // max(k, 1))
    for start in range(0, n, step):
        rows = weight[start:start + step].float()
        scale = rows.abs().amax(dim=1) / INT8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(rows / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
        values[start:start + step] = (q + 128).to(torch.uint8)
        scales[start:start + step, 0] = scale
    return QuantizedTensor(values, scales, None, 8, "wint8")


def quantize_wint4(weight: torch.Tensor, group_size: int = WINT4_GROUP_SIZE) -> QuantizedTensor:
    """Per group of ``group_size`` input features of each row, asymmetric (min to max
    over 16 levels), scale and offset in float16::

        d = float16((max - min) / 15)   (1 where max == min)   m = float16(min)
        q = round((W - m) / d) in [0, 15]

    Asymmetric rather than symmetric: 16 levels over [min, max] instead of 15 over
    [-amax, amax], for one more float16 per group. Measured on SmolLM2's linear weights
    (as its Q4_1 file dequantizes them), groups of 64: round-trip RMS error 0.71x the
    symmetric one's."""
    n, k = weight.shape
    if group_size % KERNEL_BLOCK or k % group_size:
        raise ValueError(f"wint4 groups of {group_size} must be a multiple of {KERNEL_BLOCK} "
                         f"that divides the {k} input features")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    low, high = w.amin(dim=2), w.amax(dim=2)
    d = ((high - low) / 15).half()
    d = torch.where(d > 0, d, torch.ones_like(d))
    m = low.half()
    q = torch.round((w - m.float()[..., None]) / d.float()[..., None]).clamp_(0, 15)
    return QuantizedTensor(q.to(torch.uint8).reshape(n, k), d, m, 4, "wint4")


def reference_linear(x: torch.Tensor, weight: QuantizedTensor,
                     bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight dequantized, bias)`` with sums in float32 and one rounding to
    ``out_dtype`` (``x.dtype`` by default) at the end: the PyTorch path, and what the
    kernel is compared with."""
    out = F.linear(x.float(), weight.dequantize(torch.float32),
                   None if bias is None else bias.float())
    return out.to(out_dtype or x.dtype)


def kernel_error_bound(x: torch.Tensor, weight: QuantizedTensor,
                       integer_x: bool | None = None) -> torch.Tensor:
    """An upper bound on |kernel - reference| for each output of ``x @ W^T``, from the
    rounding steps both take. Float32 sums: each sum of at most K + 2 float32 terms per
    output (the kernel's per-group or per-span sums, their scaling, the reference's
    matmul) rounds by at most (K + 2) 2^-24 of the sum of the magnitudes it adds, which
    |x| (|d| A + |m|) bounds term by term; four such sums at most (S, d S + m X, the
    groups, the reference). A: the largest value the kernel sums (quant_gemm.cpp), 4-,
    5- and 6-bit values as 128 + q or q - 2^(bits-1), 8-bit ones as q - 128: below 2^8,
    the bias taken back with d X.

    ``integer_x`` (default: whether the path ``quantized_linear`` takes now for x's
    rows multiplies integers: the AVX2 kernel; on AVX-512 with VNNI, every row count
    under batch invariance (the default), else 1-8 rows; ``quant_gemm_rounds_x``): x is rounded to a step of
    2^(E - 14) per block of 32 features, E the exponent of the block's largest |x|; every
    product and sum of products after that is exact. So each x moves by at most half its
    block's step, and an output by that times |w| summed over the row."""
    if integer_x is None:
        from loom.kernels import native_ops  # (a cycle at import time otherwise)
        ops = native_ops()
        integer_x = (ops is not None and ops.quant_gemm_available()
                     and ops.quant_gemm_rounds_x(x.shape[0]))
    x = x.float()
    group = weight.group_size
    d, m = weight.scales_and_offsets()
    # (the AVX2 kernel sums 4-bit values as stored, q below 2^4, under the old 2^5)
    amplitude = d.abs() * (2 ** 5 if weight.bits == 4 and integer_x else 2 ** 8)
    if m is not None:
        amplitude = amplitude + m.abs()
    amplitude = amplitude.repeat_interleave(group, dim=1)  # (N, K)
    k = x.shape[1]
    bound = 4 * (k + 2) * 2.0 ** -24 * (x.abs() @ amplitude.t()) + 1e-30
    if integer_x:
        blocks = torch.nn.functional.pad(x.abs(), (0, -k % 32)).view(x.shape[0], -1, 32)
        largest = blocks.amax(dim=2)
        exponent = torch.frexp(largest)[1] - 1  # largest in [2^E, 2^(E+1))
        step = torch.where(largest > 0, torch.ldexp(torch.ones_like(largest),
                                                    exponent.clamp(min=-126) - 14), 0.0)
        half_step = (step / 2).repeat_interleave(32, dim=1)[:, :k]
        bound = bound + half_step @ weight.dequantize(torch.float32).abs().t()
    return bound


def fitting_group_size(group_size: int, in_features: int) -> int:
    """``group_size``, or the largest smaller power-of-two multiple of 32 that divides
    ``in_features`` (this rank's: a row-parallel shard), so that groups never straddle
    a shard (SmolLM2's 576 features take groups of 64 under the default 128)."""
    size = group_size
    while size > KERNEL_BLOCK and in_features % size:
        size //= 2
    if in_features % size:
        raise ValueError(f"{in_features} input features are not a multiple of "
                         f"{KERNEL_BLOCK}, the smallest wint4 group")
    return size
