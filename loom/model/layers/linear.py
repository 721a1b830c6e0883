"""Linear layers that own their tensor-parallel sharding.

Column parallel splits the output features across ranks (no communication);
row parallel splits the input features and sums the partial products with an
all-reduce. A column-parallel layer followed by a row-parallel one (QKV → O,
gate_up → down) needs one all-reduce per pair.

Every parameter carries ``weight_loader(param, loaded_weight, shard_id=None)``,
which takes the full checkpoint tensor and copies this rank's slice into ``param``.

With ``quantization`` wint8 or wint4, or a weight that arrives quantized (a GGUF Q4_1
tensor), a layer holds its weight quantized (``LinearBase``; layers/quantization.py).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.envs import settings
from loom.kernels import native_ops, native_ops_for
from loom.model.layers.quantization import (QuantizedTensor, fitting_group_size,
                                            parse_weight_quantization, quantize,
                                            reference_linear)
from loom.model.layers.scratch import scratch

logger = logging.getLogger(__name__)
_logged: set[tuple] = set()


def _log_once(message: str, *args: object) -> None:
    """Log a line once per process for what every layer of a kind would repeat."""
    if (message, args) not in _logged:
        _logged.add((message, args))
        logger.info(message, *args)


class PackedWeight:
    """A linear layer's bf16 weight laid out once for a CPU matmul kernel: loom's own
    (``bf16_linear``, AVX512-BF16) or, on other CPUs, oneDNN's blocked layout."""

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
    not apply (not bf16 on the CPU, ``LOOM_CPU_PACKED_WEIGHTS=0``).

    With the native kernels on an AVX512-BF16 CPU: loom's ``bf16_linear`` panels, for
    every batch size (30 layers of SmolLM2, benchmarks/cpu_kernels.py: 1 row 5.2 ms
    against ATen's GEMV 5.4, 32 rows 9.1 against packed oneDNN 13.1, 128 rows 28.8
    against 34.2). Elsewhere oneDNN's blocked layout, which it would otherwise redo
    on every call (batch 8 40% faster packed). loom's panels replace a linear layer's
    plain weight (``LinearBase``: one copy resident), an LM head's too (the embedding
    tied to it gathers its rows from them, ``PackedWeight.rows``); oneDNN's layout is a
    second copy, the plain one staying for its one-row path."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 \
            or not settings().cpu_packed_weights:
        return None
    ops = native_ops_for(weight.device, weight.dtype)
    if ops is not None and ops.bf16_gemm_available() and weight.shape[1] % 2 == 0:
        return PackedWeight(ops.pack_bf16_weight(weight.detach()), weight.shape[0], ops)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32),
                            weight.shape[0])
    except (RuntimeError, AttributeError):
        return None


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


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                          shard_id: object = None) -> None:
    """Copy a replicated (unsharded) tensor whole."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded_weight.shape)} but the "
                         f"parameter has {tuple(param.shape)}; the config does not match "
                         "the weights")
    param.data.copy_(loaded_weight)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shard of shape {tuple(src.shape)} does not fit parameter slice "
                         f"{tuple(dst.shape)}; the config does not match the weights")
    dst.copy_(src)


class RowBlocks:
    """A quantized layer's weight while it loads: row blocks, top to bottom, each a
    ``QuantizedTensor`` in the layout of the shard written there.

    One block while every shard comes in one layout (copied in place, as into a single
    tensor). A fused layer whose projections come in different formats (a GGUF Q4_K_M
    file's Q4_K ``attn_q``/``attn_k`` with a Q6_K ``attn_v``, Q4_K ``ffn_gate`` with Q6_K
    ``ffn_up``) gets a block per run of rows in one layout, each kept in its own format:
    ``LinearBase`` runs each block's matmul into its columns of the output. Shaped like
    what a subclass's ``weight_loader`` writes into: ``shape``, ``dim()``, ``narrow``
    (rows) and ``copy_``."""

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

    def narrow(self, dim: int, start: int, length: int) -> _RowSlice:
        if dim != 0:
            raise ValueError("a quantized layer's weight takes its shards as rows")
        return _RowSlice(self, start, length)

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


class _RowSlice:
    """Rows ``start .. start + length`` of a ``RowBlocks`` (a fused layer's shard)."""

    def __init__(self, owner: RowBlocks, start: int, length: int) -> None:
        self.owner, self.start = owner, start
        self.shape = torch.Size((length, owner.shape[1]))

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> _RowSlice:
        if dim != 0:
            raise ValueError("a quantized layer's weight takes its shards as rows")
        return _RowSlice(self.owner, self.start + start, length)

    def copy_(self, src: QuantizedTensor) -> _RowSlice:
        if src.shape != self.shape:
            raise ValueError(f"shard of shape {tuple(src.shape)} does not fit rows "
                             f"{self.start}:{self.start + self.shape[0]} of a "
                             f"{tuple(self.owner.shape)} weight")
        self.owner.write(self.start, src)
        return self


def _one_buffer(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
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


class _Staging:
    """What a subclass's ``weight_loader`` writes into while a quantized layer loads:
    the parameter-shaped face (``data``, ``shape``, ``dim()``) of its ``RowBlocks``."""

    def __init__(self, data: RowBlocks) -> None:
        self.data = data
        self.shape = data.shape

    def dim(self) -> int:
        return 2


class LinearBase(nn.Module):
    """A linear layer's weight and bias, however they are held.

    ``quantization`` (layers/quantization.py) says what becomes of a full-precision
    weight: ``none`` keeps it (and packs it for the CPU matmul), ``wint8``/``wint4[:G]``
    quantize the whole checkpoint tensor in the loader, before this rank takes its
    shard. A weight that arrives quantized (a GGUF Q4_1 tensor under ``auto``) is kept
    in its format. Once loaded (``process_weights_after_loading``), a quantized layer
    holds either loom's kernel layout (``quant_weight``; ``weight`` is its bytes) or,
    for the PyTorch path, the values bit-packed at the format's bits (``weight``,
    uint8; ``QuantizedTensor.held``), ``weight_scale`` and ``weight_offset``, unpacked
    and dequantized per matmul; no full-precision copy stays. A fused layer whose shards came in
    different formats (``RowBlocks``) holds one weight per run of rows in one format
    (``weight_parts``: kernel layouts, or ``QuantizedTensor`` objects for the PyTorch path),
    all their bytes in the one ``weight`` parameter, and multiplies each into its
    columns of the output."""

    # made from the loaded weight (the PyTorch path's), never loaded by name
    derived_parameters = ("weight_scale", "weight_offset", "weight_super_scale",
                          "weight_super_offset")

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 tp_group: TPGroup, quantization: str = "none") -> None:
        super().__init__()
        self.tp_group = tp_group
        self.input_size = input_size
        self.output_size = output_size
        self.quantization, self.group_size = parse_weight_quantization(quantization)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self._load_weight
        # the model's device: a weight loaded from the file (on the CPU) is staged,
        # quantized or not, and held there
        self._params_dtype, self._device = self.weight.dtype, self.weight.device
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_parameter("weight_scale", None)  # quantized, PyTorch path
        self.register_parameter("weight_offset", None)
        self.register_parameter("weight_super_scale", None)  # two-level (K-quants)
        self.register_parameter("weight_super_offset", None)
        self.packed_weight: PackedWeight | None = None  # see pack_weight
        self.quant_weight = None  # the kernel's QuantizedWeight
        # several formats (RowBlocks): QuantizedWeight (kernel) or QuantizedTensor each
        self.weight_parts: list | None = None
        self._part_formats: list[str] = []
        self.weight_format: str | None = None  # Q4_1, wint8, Q4_K+Q6_K ... once quantized
        self._staging: RowBlocks | None = None  # quantized shards while loading
        self._bits = 0
        self._weight_is_panels = False  # self.weight is packed_weight's data (bf16)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        raise NotImplementedError

    def _load_weight(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantizedTensor,
                     shard_id: object = None) -> None:
        """The weight's loader: a full-precision tensor into a ``none`` layer goes to the
        subclass's loader as is; anything quantized (or to be quantized, from the whole
        tensor) goes into the quantized staging, shard by shard."""
        if isinstance(loaded_weight, QuantizedTensor) \
                and not loaded_weight.splits_into(self.input_size):
            # this rank's input features would cut the file's blocks (a row-parallel
            # shard): the layer goes to full precision rather than refuse to start
            _log_once("%s weights of %d input features split over tensor-parallel ranks "
                      "into %d, which cuts their %s: such layers are dequantized to the "
                      "model's dtype (a tensor-parallel size that divides them keeps them "
                      "quantized)", loaded_weight.format, loaded_weight.shape[1],
                      self.input_size, "256-feature super-blocks" if loaded_weight.two_level
                      else f"groups of {loaded_weight.group_size}")
            loaded_weight = loaded_weight.dequantize()
        if not isinstance(loaded_weight, QuantizedTensor) and self.quantization != "none":
            group = self.group_size
            if self.quantization == "wint4":
                group = fitting_group_size(self.group_size, self.input_size)
                if group != self.group_size:
                    _log_once("wint4: groups of %d for layers of %d input features per rank "
                              "(%d does not divide them)", group, self.input_size,
                              self.group_size)
            loaded_weight = quantize(loaded_weight, self.quantization, group)
        if not isinstance(loaded_weight, QuantizedTensor):
            if self.weight_format is not None or self._staging is not None:
                self._to_full_precision()
            if self._weight_is_panels:
                self._unpack_panels()
            self.weight_loader(self.weight, loaded_weight, shard_id)
            return
        if self._staging is None:
            if self.weight_format is not None and self._holds_weight():
                self._staging = self._unpack_blocks()  # loaded before: reload into it
            else:
                self._staging = RowBlocks([QuantizedTensor.empty(
                    loaded_weight, (self.output_size, self.input_size), self._device)])
        # a shard in another layout than the rows it lands on (one projection of a fused
        # layer in another format: a GGUF file mixing them) becomes a block of its own
        self.weight_loader(_Staging(self._staging), loaded_weight, shard_id)
        if self._staging.complete and not loaded_weight.values.is_meta:
            # Laid out as soon as its last shard is in, not after the whole model: the
            # staging (a byte per value) never holds more than a layer. A 1B Q4_0 file
            # peaked at 1.8 GB resident for 1.1 GB held. The loader's own call then
            # finds nothing staged.
            self.process_weights_after_loading()

    def _to_full_precision(self) -> None:
        """Drop quantization: the weight so far, dequantized, in the model's dtype."""
        held = self._staging if self._staging is not None else (
            self._unpack_blocks() if self.weight_format is not None and self._holds_weight()
            else None)
        weight = torch.empty(self.output_size, self.input_size, dtype=self._params_dtype,
                             device=self._device)
        if held is not None:
            weight.copy_(held.dequantize())
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self._load_weight
        self._hold_scales(None)
        self.weight_parts = self.quant_weight = self.weight_format = self._staging = None
        self.quantization = "none"

    def _unpack_panels(self) -> None:
        """Back to a plain (N, K) weight to load into (a reload: one shard of a fused
        layer keeps the other rows), from the panels, or empty if they were released."""
        weight = (self.plain_weight().clone() if self.packed_weight is not None
                  else torch.empty(self.output_size, self.input_size, dtype=self._params_dtype))
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self._load_weight
        self.packed_weight = None
        self._weight_is_panels = False

    def plain_weight(self) -> torch.Tensor:
        """This rank's (N, K) weight in full precision (a view of the panels' inverse
        if the weight is held as loom's bf16 panels)."""
        return self.packed_weight.plain() if self._weight_is_panels else self.weight

    def _holds_weight(self) -> bool:
        """Whether the quantized weight is still here (``release_weight`` drops it)."""
        return (self.quant_weight is not None or self.weight_scale is not None
                or self.weight_parts is not None)

    def release_weight(self) -> None:
        """Free what the weight is made of beyond its parameter (``quant_weight`` and
        ``weight_parts`` hold its bytes too): a weight-update sleep; the next load fills
        it whole."""
        self.quant_weight = None
        self.weight_parts = None
        self.packed_weight = None

    def _unpack_blocks(self) -> RowBlocks:
        """The held quantized weight as ``RowBlocks`` (a copy to load into)."""
        if self.weight_parts is None:
            return RowBlocks([self._unpack()])
        blocks = []
        for part, fmt in zip(self.weight_parts, self._part_formats):
            if isinstance(part, QuantizedTensor):
                blocks.append(part.expanded().clone())
            else:
                blocks.append(QuantizedTensor.unpack(native_ops(), part, fmt))
        return RowBlocks(blocks)

    def _unpack(self) -> QuantizedTensor:
        """The held quantized weight, in one format, as a ``QuantizedTensor`` (a copy)."""
        if self.weight_parts is not None:
            raise ValueError(f"a {self.weight_format} layer is held in several formats")
        if self.quant_weight is not None:
            return QuantizedTensor.unpack(native_ops(), self.quant_weight, self.weight_format)
        return self.quantized().expanded().clone()

    def process_weights_after_loading(self) -> None:
        """Called by the loader once every weight is in place (and again after a reload):
        lay a quantized weight out for its matmul, or pack a full-precision one."""
        staged, self._staging = self._staging, None
        if staged is None:
            if self.weight_format is None and not self._weight_is_panels:
                self.packed_weight = pack_weight(self.weight)
                if self.packed_weight is not None and self.packed_weight.is_loom_kernel:
                    # the panels are the weight: no second (N, K) copy stays resident
                    self.weight = nn.Parameter(self.packed_weight.data, requires_grad=False)
                    self.weight.weight_loader = self._load_weight
                    self._weight_is_panels = True
            return
        blocks = staged.merged()
        self.packed_weight = self.weight_parts = None
        ops = native_ops_for(self._device, self._params_dtype)
        kernel = (ops is not None and self._params_dtype == torch.bfloat16
                  and ops.quant_gemm_available())
        if len(blocks) > 1:
            self._hold_parts(blocks, ops if kernel else None)
            return
        staged = blocks[0]
        self.weight_format, self._bits = staged.format, staged.bits
        if kernel:
            self.quant_weight = staged.pack(ops)
            self.weight = nn.Parameter(self.quant_weight.data, requires_grad=False)
            self._hold_scales(None)
        else:  # the PyTorch path: the values bit-packed, at the format's own size
            held = staged.held()
            self.quant_weight = None
            self.weight = nn.Parameter(held.values, requires_grad=False)
            self._hold_scales(held)
        self.weight.weight_loader = self._load_weight

    def _hold_scales(self, staged: QuantizedTensor | None) -> None:
        """The PyTorch path's scale parameters: ``staged``'s, or none (loom's kernel
        holds them in its layout)."""
        tensors = [None] * 4 if staged is None else [
            staged.scales, staged.offsets, staged.super_scales, staged.super_offsets]
        for name, tensor in zip(("weight_scale", "weight_offset", "weight_super_scale",
                                 "weight_super_offset"), tensors):
            setattr(self, name,
                    None if tensor is None else nn.Parameter(tensor, requires_grad=False))

    def _hold_parts(self, blocks: list[QuantizedTensor], ops) -> None:
        """Hold ``blocks`` (runs of rows, each in one format) each in its own layout:
        packed for loom's kernel with ``ops``, else as they are for the PyTorch path;
        their bytes in one ``weight`` parameter."""
        self.quant_weight = None
        self._part_formats = [block.format for block in blocks]
        self.weight_format = "+".join(dict.fromkeys(self._part_formats))
        if ops is not None:
            parts = [block.pack(ops) for block in blocks]
            buffer, views = _one_buffer([part.data for part in parts])
            for part, view in zip(parts, views):
                part.data = view
        else:
            blocks = [block.held() for block in blocks]
            tensors = [block.tensors() for block in blocks]
            buffer, views = _one_buffer([t for group in tensors for t in group])
            parts, at = [], 0
            for block, group in zip(blocks, tensors):
                parts.append(block.with_tensors(views[at:at + len(group)]))
                at += len(group)
        self.weight_parts = parts
        self.weight = nn.Parameter(buffer, requires_grad=False)
        self._hold_scales(None)
        self.weight.weight_loader = self._load_weight

    @property
    def on_reference_path(self) -> bool:
        """Quantized, and multiplied by the PyTorch reference (dequantized per matmul)."""
        return (self.weight_format is not None and self.quant_weight is None
                and not self.parts_on_kernel)

    @property
    def parts_on_kernel(self) -> bool:
        """Held in several formats, each in loom's kernel layout."""
        return bool(self.weight_parts) and not isinstance(self.weight_parts[0],
                                                          QuantizedTensor)

    def quantized(self) -> QuantizedTensor | None:
        """The PyTorch path's quantized weight (None for loom's kernel, unquantized, or
        several formats: ``weight_parts``)."""
        if self.weight_format is None or self.quant_weight is not None \
                or self.weight_parts is not None:
            return None
        return QuantizedTensor(self.weight, self.weight_scale, self.weight_offset, self._bits,
                               self.weight_format, self.weight_super_scale,
                               self.weight_super_offset, packed=True)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
               float_output: bool = False) -> torch.Tensor:
        """``x W^T (+ bias)`` on this rank's weight, however it is held; with
        ``float_output``, float32 (the kernels' sums unrounded where they have them)."""
        if self.quant_weight is not None:
            flat = x.reshape(-1, x.shape[-1])
            if flat.stride(-1) != 1:
                flat = flat.contiguous()
            out = torch.empty(flat.shape[0], self.output_size,
                              dtype=torch.float32 if float_output else x.dtype)
            native_ops().quantized_linear(out, flat, self.quant_weight, bias)
            return out.view(*x.shape[:-1], self.output_size)
        if self.weight_parts is not None:
            out = self._matmul_parts(x, bias, float_output)
        elif self.weight_format is not None:
            out = reference_linear(x, self.quantized(), bias,
                                   torch.float32 if float_output else None)
        elif self._weight_is_panels and x.dtype != torch.bfloat16:  # a rare caller
            out = F.linear(x, self.plain_weight().to(x.dtype), bias)
        else:
            out = linear(x, self.weight, bias, self.packed_weight, float_output=float_output)
        return out.float() if float_output else out

    def _matmul_parts(self, x: torch.Tensor, bias: torch.Tensor | None,
                      float_output: bool) -> torch.Tensor:
        """``matmul`` of a layer held in several formats: each part's rows of the
        weight into its columns of the output (its own kernel call)."""
        flat = x.reshape(-1, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(flat.shape[0], self.output_size,
                          dtype=torch.float32 if float_output else x.dtype, device=x.device)
        first = 0
        for part in self.weight_parts:
            rows = part.shape[0] if isinstance(part, QuantizedTensor) else part.out_features
            part_bias = None if bias is None else bias.narrow(0, first, rows)
            columns = out.narrow(1, first, rows)
            if isinstance(part, QuantizedTensor):
                columns.copy_(reference_linear(flat, part, part_bias, out.dtype))
            else:
                native_ops().quantized_linear(columns, flat, part, part_bias)
            first += rows
        return out.view(*x.shape[:-1], self.output_size)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_group: TPGroup = SINGLE, quantization: str = "none") -> None:
        super().__init__(input_size, output_size, bias, tp_group, quantization)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """``y = x W^T`` with W's rows (output features) split across ranks.

    Returns this rank's slice of the output unless ``gather_output``."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_group: TPGroup = SINGLE, gather_output: bool = False,
                 quantization: str = "none") -> None:
        start, end = tp_group.shard_range(output_size)
        super().__init__(input_size, end - start, bias, tp_group, quantization)
        self.gather_output = gather_output

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        size = param.shape[0]
        shard = loaded_weight.narrow(0, self.tp_group.rank * size, size)
        _copy_checked(param.data, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return self.tp_group.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul
    (``gate_proj, up_proj → gate_up_proj``); ``shard_id`` is the index into
    ``output_sizes``. Each rank holds ``[gate_r | up_r]``."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp_group: TPGroup = SINGLE, quantization: str = "none") -> None:
        for size in output_sizes:
            tp_group.shard_range(size)  # validates divisibility
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp_group,
                         quantization=quantization)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id (0, 1, ...)")
        tp = self.tp_group.world_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        shard = loaded_weight.narrow(0, self.tp_group.rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections; shard ids ``"q"``, ``"k"``, ``"v"``.

    Query heads are split across ranks. KV heads are split too when there are at
    least as many as ranks; otherwise each KV head is replicated on
    ``tp_size // total_num_kv_heads`` consecutive ranks, so that every rank holds
    the one KV head its query heads attend with."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False,
                 tp_group: TPGroup = SINGLE, quantization: str = "none") -> None:
        tp = tp_group.world_size
        if total_num_heads % tp:
            raise ValueError(f"{total_num_heads} attention heads are not divisible by "
                             f"tensor parallel size {tp}")
        if tp >= total_num_kv_heads:
            if tp % total_num_kv_heads:
                raise ValueError(f"tensor parallel size {tp} is not a multiple of the "
                                 f"{total_num_kv_heads} KV heads")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp // total_num_kv_heads
        else:
            if total_num_kv_heads % tp:
                raise ValueError(f"{total_num_kv_heads} KV heads are not divisible by "
                                 f"tensor parallel size {tp}")
            self.num_kv_heads = total_num_kv_heads // tp
            self.num_kv_head_replicas = 1
        self.head_size = head_size
        self.num_heads = total_num_heads // tp
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        # Sizes are per rank already; build the base with tp-scaled totals.
        LinearBase.__init__(self, hidden_size, self.q_size + 2 * self.kv_size, bias, tp_group,
                            quantization)
        self.gather_output = False

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        rank = self.tp_group.rank
        if shard_id == "q":
            offset, size, shard_index = 0, self.q_size, rank
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, shard_index = self.kv_size, rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        shard = loaded_weight.narrow(0, shard_index * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard)


class RowParallelLinear(LinearBase):
    """``y = x W^T`` with W's columns (input features) split across ranks; the input
    arrives already split (from a column-parallel layer) and partial outputs are
    summed with an all-reduce. The bias is added once, after the sum."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp_group: TPGroup = SINGLE, reduce_results: bool = True,
                 quantization: str = "none", float_output: bool = False) -> None:
        start, end = tp_group.shard_range(input_size)
        super().__init__(end - start, output_size, bias, tp_group, quantization)
        self.reduce_results = reduce_results
        # float32 output: a decoder layer's last linear, whose sums join the float32
        # residual stream unrounded (layers/layernorm.py)
        self.float_output = float_output

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if param.dim() == 1:  # bias: replicated
            default_weight_loader(param, loaded_weight)
            return
        size = param.shape[1]
        shard = loaded_weight.narrow(1, self.tp_group.rank * size, size)
        _copy_checked(param.data, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, None, self.float_output)
        if self.reduce_results:
            self.tp_group.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
