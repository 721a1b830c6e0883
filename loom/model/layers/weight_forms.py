"""How a linear layer's weight is held once loaded: one object per form.

A linear layer (``LinearBase``, linear.py) or one expert of a MoE layer (fused_moe.py)
loads its weight as the checkpoint gives it, full precision or quantized, and then
holds it in exactly one of these forms, which ``select_form`` picks, in one place, and
logs why:

    form                 holds                                   matmul
    PlainWeight          the (N, K) weight                       ATen (``torch.mv`` for one row)
    OneDnnWeight         the (N, K) weight + oneDNN's blocked    oneDNN (ATen for one row)
    Bf16Panels           loom's bf16 panels only                 loom's ``bf16_linear``
    QuantizedKernel      loom's quantized kernel layout          loom's ``quantized_linear``
    QuantizedReference   the values bit-packed + their scales    dequantize, then ``F.linear``
    TritonQuantized      as QuantizedReference (CUDA, opt-in:    loom's Triton kernels, which
                         LOOM_TRITON_MATMULS=1)                  dequantize in registers
    MixedFormats         one of the two above per run of rows    one call per run, into its
                         in one format (a fused GGUF layer)      columns of the output

Every form answers the same few questions: ``tensors()`` (the bytes it holds, which the
layer registers as its parameters), ``apply`` (``x W^T + bias``), ``native_handle``
(the ``LinearWeight`` loom's experts kernel takes, or the sentence saying why it
cannot), ``loaded_again`` (what a reload of some shards writes into: what is held, so
the rows not reloaded keep their values) and ``release`` (a weight-update sleep drops
what holds the bytes beyond the parameters). A layer while it loads holds its weight
plain (``PlainWeight``) or, quantized, as ``RowBlocks``; ``select_form`` turns that into
the form it runs.
"""

from __future__ import annotations

import importlib.util
import logging
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F

from loom.envs import settings
from loom.kernels import native_ops, native_ops_for
from loom.model.attention import triton_interpreter_requested
from loom.model.layers.quantization import QuantizedTensor, reference_linear
from loom.model.layers.scratch import scratch

logger = logging.getLogger(__name__)
_logged: set[tuple] = set()


def log_once(message: str, *args: object) -> None:
    """Log a line once per process for what every layer of a kind would repeat."""
    if (message, args) not in _logged:
        _logged.add((message, args))
        logger.info(message, *args)


# ------------------------------------------------------------------ bf16 matmul layouts

class PackedWeight:
    """A bf16 weight laid out once for a CPU matmul kernel: loom's own (``bf16_linear``,
    AVX512-BF16) or, on other CPUs, oneDNN's blocked layout."""

    __slots__ = ("data", "out_features", "_ops")

    def __init__(self, data: torch.Tensor, out_features: int, ops=None) -> None:
        self.data = data
        self.out_features = out_features
        self._ops = ops  # the native kernels for loom's layout, None for oneDNN's

    @classmethod
    def loom_panels(cls, data: torch.Tensor, out_features: int) -> PackedWeight:
        """Panels ``pack_weight`` made for loom's ``bf16_linear`` (``data``, e.g. one
        expert's slice of a stack of them), for a weight of ``out_features`` rows."""
        return cls(data, out_features, native_ops_for(data.device, data.dtype))

    def plain(self) -> torch.Tensor:
        """The (N, K) weight loom's panels hold, as a view of them (not for oneDNN's)."""
        panels, pairs, width = self.data.shape[:3]
        return self.data.permute(0, 2, 1, 3).reshape(panels * width, 2 * pairs)[
            :self.out_features]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the (N, K) weight, gathered from loom's panels:
        an embedding lookup in a table held only as its tied LM head's panels."""
        flat = ids.reshape(-1).long().contiguous()
        out = torch.empty(flat.numel(), 2 * self.data.shape[1], dtype=self.data.dtype)
        self._ops.bf16_gather_rows(out, self.data, flat, self.out_features)
        return out.view(*ids.shape, out.shape[-1])

    @property
    def is_loom_kernel(self) -> bool:
        """Packed for loom's ``bf16_linear`` (else for oneDNN)."""
        return self._ops is not None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
               float_output: bool = False, out_owner: object = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for a 2-d ``x`` whose last dim is contiguous;
        with ``float_output`` loom's kernel returns its float32 sums unrounded, into
        ``out_owner``'s scratch buffer if given (``scratch``)."""
        if self._ops is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")
        shape = (x.shape[0], self.out_features)
        dtype = torch.float32 if float_output else x.dtype
        out = (torch.empty(shape, dtype=dtype) if out_owner is None
               else scratch(out_owner, shape, dtype, x.device))
        self._ops.bf16_linear(out, x, self.data, bias)
        return out


def pack_weight(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` (N, K) reordered once for a CPU bf16 matmul, or None where that does
    not apply (see ``full_precision_form``, which says why)."""
    packed, _ = _pack(weight)
    return packed


def _pack(weight: torch.Tensor) -> tuple[PackedWeight | None, str]:
    """``pack_weight`` and the reason for its answer.

    With the native kernels on an AVX512-BF16 CPU: loom's ``bf16_linear`` panels, for
    every batch size (30 layers of SmolLM2, benchmarks/cpu_kernels.py: 1 row 5.2 ms
    against ATen's GEMV 5.4, 32 rows 9.1 against packed oneDNN 13.1, 128 rows 28.8
    against 34.2). Elsewhere oneDNN's blocked layout, which it would otherwise redo
    on every call (batch 8 40% faster packed)."""
    if weight.device.type != "cpu":
        return None, f"on {weight.device.type}, ATen's matmul"
    if weight.dtype != torch.bfloat16:
        return None, f"{str(weight.dtype).removeprefix('torch.')}: ATen's matmul"
    if not settings().cpu_packed_weights:
        return None, "LOOM_CPU_PACKED_WEIGHTS=0"
    ops = native_ops_for(weight.device, weight.dtype)
    if ops is not None and ops.bf16_gemm_available() and weight.shape[1] % 2 == 0:
        return (PackedWeight(ops.pack_bf16_weight(weight.detach()), weight.shape[0], ops),
                "loom's bf16 kernel (AVX512-BF16)")
    why = ("no loom kernels" if ops is None else "no AVX512-BF16 for loom's bf16 kernel"
           if not ops.bf16_gemm_available() else "an odd number of input features")
    if not torch.backends.mkldnn.is_available():
        return None, f"{why} and no oneDNN: ATen's matmul"
    try:
        return (PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32),
                             weight.shape[0]), f"{why}: oneDNN's blocked layout")
    except (RuntimeError, AttributeError):
        return None, f"{why} and oneDNN cannot reorder it: ATen's matmul"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None, float_output: bool = False,
           out_owner: object = None) -> torch.Tensor:
    """``F.linear`` with CPU bf16 fast paths: the ``packed`` weight (``pack_weight``) for
    any number of rows if it is loom's, for more than one if oneDNN's; a single row
    otherwise goes to ATen's GEMV (``torch.mv``: 5.6 ms for 30 layers of SmolLM2 against
    oneDNN's 9.2 unpacked, 7.1 packed), chosen by shape, not by switching oneDNN off
    process-wide around the call. ``float_output``: the result may
    be float32 where the kernel has it unrounded (an LM head's logits); ``out_owner``:
    the result may live in that owner's scratch buffer, valid until its next call.
    On CUDA, ``float_output`` takes cuBLAS's float32 sums of a bf16 or float16 matmul
    unrounded (``cuda_float_sums``)."""
    if x.dtype != torch.bfloat16 or not x.is_cpu:
        if float_output and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            return cuda_float_sums(x, weight, bias)
        return F.linear(x, weight, bias)
    rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
    if packed is not None and (packed.is_loom_kernel or rows > 1):
        if x.dim() == 2 and x.stride(-1) == 1:
            return packed.matmul(x, bias, float_output, out_owner)
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        return packed.matmul(flat, bias, float_output, out_owner).view(
            *x.shape[:-1], packed.out_features)
    if rows == 1:  # ATen's GEMV; F.linear would take oneDNN's slower one-row path
        vector = x.reshape(-1)
        out = torch.mv(weight, vector) if bias is None else torch.addmv(bias, weight, vector)
        return out.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


_MM_HAS_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch.mm's out_dtype (2.8 on)


def cuda_float_sums(x: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bf16/float16 operands on CUDA, as float32: the
    matmul's float32 accumulators, not rounded to the operands' dtype on the way out
    (``torch.mm``'s ``out_dtype``). A layer's last linears feed the float32 residual
    stream with them, as the CPU kernels do (layernorm.py): rounding them to bf16
    cost the default model's Q4_1 file a point of top-1 agreement with its float32
    self on the module path (tests/model/test_quantization.py)."""
    flat = x.reshape(-1, x.shape[-1])
    if _MM_HAS_OUT_DTYPE:
        out = torch.mm(flat, weight.t(), out_dtype=torch.float32)
    else:
        out = torch.mm(flat.float(), weight.t().float())
    if bias is not None:
        out += bias.float()
    return out.view(*x.shape[:-1], weight.shape[0])


# ------------------------------------------------------------------ quantized loading

class RowBlocks:
    """A quantized weight while it loads: row blocks, top to bottom, each a
    ``QuantizedTensor`` in the layout of the shard written there.

    One block while every shard comes in one layout (copied in place, as into a single
    tensor). A fused layer whose projections come in different formats (a GGUF Q4_K_M
    file's Q4_K ``attn_q``/``attn_k`` with a Q6_K ``attn_v``, Q4_K ``ffn_gate`` with Q6_K
    ``ffn_up``) gets a block per run of rows in one layout, each kept in its own format
    (``MixedFormats``). Shaped like what a layer's ``weight_loader`` writes into:
    ``shape``, ``dim()``, ``narrow`` (rows) and ``copy_``."""

    def __init__(self, blocks: list[QuantizedTensor]) -> None:
        self.blocks = blocks
        self.rows_written = 0  # rows that shards have filled (each row is written once)

    @property
    def complete(self) -> bool:
        """Every row has been written: the layer has its whole weight."""
        return self.rows_written >= self.shape[0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(b.shape[0] for b in self.blocks), self.blocks[0].shape[1]))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> RowSlice:
        if dim != 0:
            raise ValueError("a quantized layer's weight takes its shards as rows")
        return RowSlice(self, start, length)

    def copy_(self, src: QuantizedTensor) -> RowBlocks:
        self.write(0, src)
        return self

    def write(self, start: int, src: QuantizedTensor) -> None:
        """Rows ``start .. start + len(src)`` become ``src``: copied in place where they
        lie in one block of its layout, else a block of their own (the blocks around
        them cut at its edges)."""
        end = start + src.shape[0]
        self.rows_written += src.shape[0]
        first = 0
        for block in self.blocks:
            rows = block.shape[0]
            if first <= start and end <= first + rows and block.same_layout(src):
                block.narrow(0, start - first, end - start).copy_(src)
                return
            first += rows
        above, below, first = [], [], 0
        for block in self.blocks:
            rows = block.shape[0]
            if first < start:  # rows above src's
                kept = min(rows, start - first)
                above.append(block if kept == rows else block.narrow(0, 0, kept).clone())
            if first + rows > end:  # rows below
                skip = max(0, end - first)
                below.append(block if skip == 0 else block.narrow(0, skip, rows - skip).clone())
            first += rows
        # a copy of src on the layer's device (src may come from the file, on the CPU)
        held = src.to(self.blocks[0].values.device)
        self.blocks = above + [held if held is not src else src.clone()] + below

    def merged(self) -> list[QuantizedTensor]:
        """The blocks with neighbours of one layout stacked into one."""
        runs: list[list[QuantizedTensor]] = []
        for block in self.blocks:
            if runs and runs[-1][0].same_layout(block):
                runs[-1].append(block)
            else:
                runs.append([block])
        return [QuantizedTensor.cat(run) for run in runs]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([block.dequantize(dtype) for block in self.blocks])


class RowSlice:
    """Rows ``start .. start + length`` of a ``RowBlocks`` (a fused layer's shard)."""

    def __init__(self, owner: RowBlocks, start: int, length: int) -> None:
        self.owner, self.start = owner, start
        self.shape = torch.Size((length, owner.shape[1]))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> RowSlice:
        if dim != 0:
            raise ValueError("a quantized layer's weight takes its shards as rows")
        return RowSlice(self.owner, self.start + start, length)

    def copy_(self, src: QuantizedTensor) -> RowSlice:
        if src.shape != self.shape:
            raise ValueError(f"shard of shape {tuple(src.shape)} does not fit rows "
                             f"{self.start}:{self.start + self.shape[0]} of a "
                             f"{tuple(self.owner.shape)} weight")
        self.owner.write(self.start, src)
        return self


# ------------------------------------------------------------------ the forms

class WeightForm(ABC):
    """One way a linear weight is held once loaded (see the module's table)."""

    kind: str  # what the start-up log calls it
    format: str | None = None  # a quantized format (Q4_1, wint8, Q4_K+Q6_K ...); None: bf16/fp
    dequantizes_per_matmul = False  # the PyTorch reference path (correct, not fast)

    @abstractmethod
    def tensors(self) -> dict[str, torch.Tensor]:
        """The bytes this form holds, by the parameter names the layer registers them
        under (``weight`` first)."""

    @abstractmethod
    def apply(self, x: torch.Tensor, bias: torch.Tensor | None,
              float_output: bool = False) -> torch.Tensor:
        """``x W^T (+ bias)``; with ``float_output``, float32 (the kernels' sums
        unrounded where they have them)."""

    def native_handle(self, ops: Any) -> Any:
        """The ``LinearWeight`` loom's experts kernel multiplies by, or a sentence
        (after "the <role> ") saying why this form has none."""
        return ("weight is not packed for loom's bf16 matmul (which needs AVX512-BF16)"
                if self.format is None else
                f"weight is {self.format} on the PyTorch path (no loom kernel for it on "
                "this CPU)")

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the (N, K) weight in ``dtype``: an embedding
        lookup in a table held in this form."""
        raise NotImplementedError(f"a weight held as {self.kind} gives no rows")

    @abstractmethod
    def loaded_again(self) -> torch.Tensor | RowBlocks | None:
        """What a reload of some shards writes into: a copy of what is held, plain
        (N, K) for a full-precision form, ``RowBlocks`` for a quantized one; None once
        ``release`` dropped it (the reload then fills the whole weight)."""

    def release(self) -> None:
        """A weight-update sleep frees the parameters: drop every other reference to
        their bytes."""


class PlainWeight(WeightForm):
    """The (N, K) weight as it loaded: ATen's matmul (``torch.mv`` for one row)."""

    kind = "plain"

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight}

    def plain(self) -> torch.Tensor:
        return self.weight

    def apply(self, x, bias, float_output=False):
        out = linear(x, self.weight, bias, float_output=float_output)
        return out.float() if float_output else out

    def rows(self, ids, dtype):
        return F.embedding(ids, self.weight)

    def loaded_again(self) -> torch.Tensor:
        return self.weight  # loaded in place: its rows not reloaded stay


class OneDnnWeight(PlainWeight):
    """The (N, K) weight and oneDNN's blocked copy of it (CPUs without AVX512-BF16):
    oneDNN for several rows, ATen's GEMV for one (faster there)."""

    kind = "oneDNN blocked"

    def __init__(self, weight: torch.Tensor, packed: PackedWeight) -> None:
        super().__init__(weight)
        self.packed: PackedWeight | None = packed

    def apply(self, x, bias, float_output=False):
        out = linear(x, self.weight, bias, self.packed, float_output=float_output)
        return out.float() if float_output else out

    def release(self) -> None:
        self.packed = None


class Bf16Panels(WeightForm):
    """loom's bf16 panels (``bf16_linear``), which replace the (N, K) weight: one copy
    resident."""

    kind = "loom bf16 panels"

    def __init__(self, packed: PackedWeight) -> None:
        self.packed: PackedWeight | None = packed
        self._shape = (packed.out_features, 2 * packed.data.shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.packed.data}

    def plain(self) -> torch.Tensor:
        """The (N, K) weight, a view of the panels."""
        return self.packed.plain()

    def apply(self, x, bias, float_output=False):
        if x.dtype != torch.bfloat16:  # a rare caller
            out = F.linear(x, self.plain().to(x.dtype), bias)
        else:
            out = linear(x, self.packed.data, bias, self.packed, float_output=float_output)
        return out.float() if float_output else out

    def native_handle(self, ops):
        return ops.LinearWeight.bf16(self.packed.data)

    def rows(self, ids, dtype):
        return self.packed.rows(ids)

    def loaded_again(self) -> torch.Tensor | None:
        return None if self.packed is None else self.plain().clone()

    def release(self) -> None:
        self.packed = None


class QuantizedKernel(WeightForm):
    """A quantized weight in loom's kernel layout (``quantized_linear``)."""

    kind = "loom quantized kernel"

    def __init__(self, weight: Any, format: str) -> None:
        self.weight, self.format = weight, format  # the kernel's QuantizedWeight

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.weight.data}

    def apply(self, x, bias, float_output=False):
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(flat.shape[0], self.out_features,
                          dtype=torch.float32 if float_output else x.dtype)
        native_ops().quantized_linear(out, flat, self.weight, bias)
        return out.view(*x.shape[:-1], self.out_features)

    def native_handle(self, ops):
        return ops.LinearWeight.quantized(self.weight)

    def quantized_tensor(self) -> QuantizedTensor:
        """The weight unpacked from the kernel's layout (a copy)."""
        return QuantizedTensor.unpack(native_ops(), self.weight, self.format)

    def rows(self, ids, dtype):
        flat = ids.reshape(-1).long()
        out = torch.empty(flat.numel(), self.weight.in_features, dtype=dtype)
        native_ops().dequantize_rows(out, self.weight, flat)
        return out.view(*ids.shape, out.shape[-1])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight in ``dtype``, dequantized by the kernel."""
        return self.rows(torch.arange(self.out_features), dtype)

    def loaded_again(self) -> RowBlocks | None:
        return None if self.weight is None else RowBlocks([self.quantized_tensor()])

    def release(self) -> None:
        self.weight = None


class QuantizedReference(WeightForm):
    """A quantized weight bit-packed at its format's bits, with its scales (and offsets,
    and a K-quant's super-block scales): the PyTorch reference, which dequantizes the
    weight at each matmul. Where loom's kernels do not run (not bf16, not the CPU, no
    AVX2)."""

    kind = "PyTorch reference (dequantized per matmul)"
    dequantizes_per_matmul = True

    def __init__(self, tensor: QuantizedTensor) -> None:
        self.tensor: QuantizedTensor | None = tensor
        self.format = tensor.format

    @property
    def out_features(self) -> int:
        return self.tensor.shape[0]

    def tensors(self) -> dict[str, torch.Tensor]:
        held = self.tensor
        return {name: tensor for name, tensor in (
            ("weight", held.values), ("weight_scale", held.scales),
            ("weight_offset", held.offsets), ("weight_super_scale", held.super_scales),
            ("weight_super_offset", held.super_offsets)) if tensor is not None}

    def apply(self, x, bias, float_output=False):
        out = reference_linear(x, self.tensor, bias, torch.float32 if float_output else None)
        return out.float() if float_output else out

    def quantized_tensor(self) -> QuantizedTensor:
        return self.tensor.expanded().clone()

    def rows(self, ids, dtype):
        out = self.tensor.rows(ids.reshape(-1).long()).dequantize(dtype)
        return out.view(*ids.shape, out.shape[-1])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.tensor.dequantize(dtype)

    def loaded_again(self) -> RowBlocks | None:
        return None if self.tensor is None else RowBlocks([self.quantized_tensor()])

    def release(self) -> None:
        self.tensor = None


class TritonQuantized(QuantizedReference):
    """The PyTorch path's bit-packed weight multiplied by loom's Triton kernels
    (``triton_linear.py``: the values dequantized in registers, no float32 copy of the
    weight): on CUDA with ``LOOM_TRITON_MATMULS=1``. Proven against the reference only
    under Triton's interpreter so far."""

    kind = "loom's Triton kernel (dequantized in registers)"
    dequantizes_per_matmul = False

    def __init__(self, tensor: QuantizedTensor) -> None:
        from loom.model.layers.triton_linear import quantized_matmul

        super().__init__(tensor)
        self._matmul = quantized_matmul

    def apply(self, x, bias, float_output=False):
        return self._matmul(x, self.tensor, bias, torch.float32 if float_output else None)

    def apply_into(self, out: torch.Tensor, x: torch.Tensor,
                   bias: torch.Tensor | None) -> None:
        """``apply`` of a 2-d ``x`` into ``out`` (columns of a wider output)."""
        self._matmul(x, self.tensor, bias, out=out)


class MixedFormats(WeightForm):
    """A fused layer whose runs of rows came in different formats (``RowBlocks``): one
    quantized form per run, their bytes in one buffer (counted, freed and refilled
    whole), each run's matmul into its columns of the output."""

    kind = "mixed formats"

    def __init__(self, parts: list[QuantizedKernel | QuantizedReference | TritonQuantized],
                 buffer: torch.Tensor) -> None:
        self.parts, self.buffer = parts, buffer
        self.format = "+".join(dict.fromkeys(part.format for part in parts))
        self.dequantizes_per_matmul = any(part.dequantizes_per_matmul for part in parts)

    @property
    def on_kernel(self) -> bool:
        return all(isinstance(part, QuantizedKernel) for part in self.parts)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"weight": self.buffer}

    def apply(self, x, bias, float_output=False):
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out_features = sum(part.out_features for part in self.parts)
        out = torch.empty(flat.shape[0], out_features,
                          dtype=torch.float32 if float_output else x.dtype, device=x.device)
        first = 0
        for part in self.parts:
            rows = part.out_features
            part_bias = None if bias is None else bias.narrow(0, first, rows)
            columns = out.narrow(1, first, rows)
            if isinstance(part, QuantizedKernel):
                native_ops().quantized_linear(columns, flat, part.weight, part_bias)
            elif isinstance(part, TritonQuantized):
                part.apply_into(columns, flat, part_bias)
            else:
                columns.copy_(reference_linear(flat, part.tensor, part_bias, out.dtype))
            first += rows
        return out.view(*x.shape[:-1], out_features)

    def native_handle(self, ops):
        if not self.on_kernel:
            return super().native_handle(ops)
        if not hasattr(ops.LinearWeight, "quantized_parts"):
            return (f"weight is held in several formats ({self.format}) and the kernels "
                    "take one (a stale kernel build?)")
        return ops.LinearWeight.quantized_parts([part.weight for part in self.parts])

    def loaded_again(self) -> RowBlocks | None:
        if self.parts is None:
            return None
        return RowBlocks([part.quantized_tensor() for part in self.parts])

    def release(self) -> None:
        self.parts = None


# ------------------------------------------------------------------ the selector

def select_form(loaded: torch.Tensor | RowBlocks, device: torch.device,
                dtype: torch.dtype) -> WeightForm:
    """The form a weight just loaded is held in, for a model in ``dtype`` on
    ``device``: the one place this is decided. Logs the choice and why, once per
    process for each (form, reason)."""
    if isinstance(loaded, RowBlocks):
        form, why = _quantized_form(loaded.merged(), device, dtype)
    else:
        form, why = full_precision_form(loaded)
    log_once("linear weights held as %s%s: %s", form.kind,
             f" ({form.format})" if form.format else "", why)
    return form


def full_precision_form(weight: torch.Tensor) -> tuple[WeightForm, str]:
    """loom's panels (the plain weight is then dropped), oneDNN's blocked copy beside
    the plain weight, or the plain weight alone; and why."""
    packed, why = _pack(weight)
    if packed is None:
        return PlainWeight(weight), why
    if packed.is_loom_kernel:
        return Bf16Panels(packed), why
    return OneDnnWeight(weight, packed), why


def triton_matmuls_on(device: torch.device) -> bool:
    """Whether loom's Triton matmuls run for a model on ``device``: LOOM_TRITON_MATMULS=1
    and CUDA, or the CPU under Triton's interpreter (TRITON_INTERPRET=1: tests)."""
    if not settings().triton_matmuls:
        return False
    if device.type != "cuda" and not (device.type == "cpu" and triton_interpreter_requested()):
        return False
    if importlib.util.find_spec("triton") is None:
        raise ValueError("LOOM_TRITON_MATMULS=1 needs the triton package (pip install "
                         "triton); or unset LOOM_TRITON_MATMULS")
    return True


def _triton_form(blocks: list[QuantizedTensor]) -> tuple[WeightForm, str] | None:
    """The weight held for loom's Triton kernels (``TritonQuantized``, one per format
    of a fused layer), or None where a block's layout is one they do not take."""
    from loom.model.layers.triton_linear import check_supported

    held = [block.held() for block in blocks]
    for block in held:
        why = check_supported(block)
        if why is not None:
            log_once("LOOM_TRITON_MATMULS: a %s weight stays on the PyTorch reference: %s",
                     block.format, why)
            return None
    why = "LOOM_TRITON_MATMULS=1"
    if len(held) == 1:
        return TritonQuantized(held[0]), why
    tensors = [block.tensors() for block in held]
    buffer, views = one_buffer([t for group in tensors for t in group])
    parts, at = [], 0
    for block, group in zip(held, tensors):
        parts.append(TritonQuantized(block.with_tensors(views[at:at + len(group)])))
        at += len(group)
    return MixedFormats(parts, buffer), f"{why}, one call per format"


def _quantized_form(blocks: list[QuantizedTensor], device: torch.device,
                    dtype: torch.dtype) -> tuple[WeightForm, str]:
    if triton_matmuls_on(device):
        chosen = _triton_form(blocks)
        if chosen is not None:
            return chosen
    ops = native_ops_for(device, dtype)
    if device.type != "cpu":
        why = f"on {device.type}"
    elif dtype != torch.bfloat16:
        why = f"the model runs {str(dtype).removeprefix('torch.')}; loom's kernels take bf16"
    elif ops is None:
        why = "loom's native kernels are not loaded"
    elif not ops.quant_gemm_available():
        why = "this CPU has neither AVX512-BF16 with AVX512BW nor AVX2 with FMA and F16C"
    else:
        why = None
    if len(blocks) == 1:
        if why is None:
            return QuantizedKernel(blocks[0].pack(ops), blocks[0].format), "loom's kernel"
        return QuantizedReference(blocks[0].held()), why
    if why is None:
        parts = [QuantizedKernel(block.pack(ops), block.format) for block in blocks]
        buffer, views = one_buffer([part.weight.data for part in parts])
        for part, view in zip(parts, views):
            part.weight.data = view
        return MixedFormats(parts, buffer), "loom's kernel, one call per format"
    held = [block.held() for block in blocks]
    tensors = [block.tensors() for block in held]
    buffer, views = one_buffer([t for group in tensors for t in group])
    parts, at = [], 0
    for block, group in zip(held, tensors):
        parts.append(QuantizedReference(block.with_tensors(views[at:at + len(group)])))
        at += len(group)
    return MixedFormats(parts, buffer), why


def one_buffer(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``tensors`` copied into one uint8 buffer, each at a 64-byte boundary, and their
    views in it (a layer's blocks as one parameter: counted, freed and refilled whole)."""
    offsets, total = [], 0
    for tensor in tensors:
        total = -(-total // 64) * 64
        offsets.append(total)
        total += tensor.numel() * tensor.element_size()
    buffer = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
    views = []
    for tensor, offset in zip(tensors, offsets):
        view = buffer[offset:offset + tensor.numel() * tensor.element_size()]
        view = view.view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)
        views.append(view)
    return buffer, views
