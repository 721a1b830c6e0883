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

import torch
from torch import nn

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.layers.lora import LoRASlots
from loom.model.layers.quantization import (KERNEL_BLOCK, QuantizedTensor,
                                            fitting_group_size, parse_weight_quantization,
                                            quantize)
from loom.model.layers.weight_forms import (PlainWeight, QuantizedReference, RowBlocks,
                                            WeightForm, log_once, select_form)

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


def quantization_for_inputs(value: str, input_size: int) -> str:
    """``value`` (``--quantization``'s, as layers take it) for a layer of ``input_size``
    input features where its blocks divide them (wint4's groups, the kernels'
    32-feature blocks), else ``none``: a vision tower's odd sizes (Qwen2.5-VL's
    3,420-wide MLP) stay in the model's dtype rather than refuse to start."""
    method, group = parse_weight_quantization(value)
    block = group if method == "wint4" else KERNEL_BLOCK
    if method == "none" or input_size % block == 0:
        return value
    log_once("%s layers of %d input features are not a whole number of %d-feature blocks: "
             "such layers stay in the model's dtype", method, input_size, block)
    return "none"


class _Staging:
    """What a subclass's ``weight_loader`` writes into while a quantized layer loads:
    the parameter-shaped face (``data``, ``shape``, ``dim()``) of its ``RowBlocks``."""

    def __init__(self, data: RowBlocks) -> None:
        self.data = data
        self.shape = data.shape

    def dim(self) -> int:
        return 2


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor,
                                                                         requires_grad=False)


class LinearBase(nn.Module):
    """A linear layer's weight and bias: it loads them, then holds the weight in one
    form (weight_forms.py), which ``select_form`` picks once every shard is in.

    ``quantization`` (layers/quantization.py) says what becomes of a full-precision
    weight: ``none`` keeps it (the selector then packs it for the CPU matmul),
    ``wint8``/``wint4[:G]`` quantize the whole checkpoint tensor in the loader, before
    this rank takes its shard. A weight that arrives quantized (a GGUF Q4_1 tensor under
    ``auto``) is kept in its format. While loading, a full-precision weight is the
    plain ``weight`` parameter (``PlainWeight``) and a quantized one ``RowBlocks``
    (``_staging``); after, the form's tensors are the layer's parameters (``weight``,
    and the PyTorch path's ``weight_scale`` ...) and no full-precision copy of a
    quantized weight stays."""

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
        for name in self.derived_parameters:
            self.register_parameter(name, None)
        weight = _parameter(torch.empty(output_size, input_size))
        # the model's device: a weight loaded from the file (on the CPU) is staged,
        # quantized or not, and held there
        self._params_dtype, self._device = weight.dtype, weight.device
        self.form: WeightForm = PlainWeight(weight)
        self._hold(self.form)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._staging: RowBlocks | None = None  # quantized shards while loading
        # LoRA adapters applied beside the weight (layers/lora.py), when LoRA is enabled
        self.lora: LoRASlots | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: object = None) -> None:
        raise NotImplementedError

    def _hold(self, form: WeightForm) -> None:
        """Hold the weight in ``form``: its tensors become the layer's parameters (a
        plain weight's is one already, which a weight update refills in place)."""
        self.form = form
        tensors = form.tensors()
        for name in ("weight", *self.derived_parameters):
            tensor = tensors.get(name)
            setattr(self, name, None if tensor is None else _parameter(tensor))
        self.weight.weight_loader = self._load_weight

    def _load_weight(self, param: nn.Parameter, loaded_weight: torch.Tensor | QuantizedTensor,
                     shard_id: object = None) -> None:
        """The weight's loader: a full-precision tensor into a ``none`` layer goes to the
        subclass's loader as is; anything quantized (or to be quantized, from the whole
        tensor) goes into the quantized staging, shard by shard."""
        if isinstance(loaded_weight, QuantizedTensor) \
                and not loaded_weight.splits_into(self.input_size):
            # this rank's input features would cut the file's blocks (a row-parallel
            # shard): the layer goes to full precision rather than refuse to start
            log_once("%s weights of %d input features split over tensor-parallel ranks "
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
                    log_once("wint4: groups of %d for layers of %d input features per rank "
                             "(%d does not divide them)", group, self.input_size,
                             self.group_size)
            loaded_weight = quantize(loaded_weight, self.quantization, group)
        if not isinstance(loaded_weight, QuantizedTensor):
            if self._staging is not None or self.form.format is not None:
                self._to_full_precision()
            elif not isinstance(self.form, PlainWeight):  # loom's panels: back to (N, K)
                again = self.form.loaded_again()
                self._hold(PlainWeight(_parameter(again if again is not None else torch.empty(
                    self.output_size, self.input_size, dtype=self._params_dtype))))
            self.weight_loader(self.weight, loaded_weight, shard_id)
            return
        if self._staging is None:
            again = self.form.loaded_again() if self.form.format is not None else None
            self._staging = again if again is not None else RowBlocks([QuantizedTensor.empty(
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
        held = self._staging if self._staging is not None else self.form.loaded_again()
        weight = torch.empty(self.output_size, self.input_size, dtype=self._params_dtype,
                             device=self._device)
        if held is not None:
            weight.copy_(held.dequantize())
        self._staging = None
        self._hold(PlainWeight(_parameter(weight)))
        self.quantization = "none"

    def process_weights_after_loading(self) -> None:
        """Called by the loader once every weight is in place (and again after a reload):
        hold the weight in the form ``select_form`` picks for it."""
        staged, self._staging = self._staging, None
        if staged is not None:
            self._hold(select_form(staged, self._device, self._params_dtype))
        elif isinstance(self.form, PlainWeight):  # loaded (or reloaded) in place
            self._hold(select_form(self.weight, self._device, self._params_dtype))

    @property
    def weight_format(self) -> str | None:
        """The quantized format the weight is held in (Q4_1, wint8, Q4_K+Q6_K ...);
        None for a full-precision weight."""
        return self.form.format

    @property
    def on_reference_path(self) -> bool:
        """Quantized, and multiplied by the PyTorch reference (dequantized per matmul)."""
        return self.form.dequantizes_per_matmul

    def quantized(self) -> QuantizedTensor | None:
        """The PyTorch path's quantized weight (None for loom's kernel, unquantized, or
        several formats)."""
        return self.form.tensor if isinstance(self.form, QuantizedReference) else None

    def plain_weight(self) -> torch.Tensor:
        """This rank's (N, K) weight in full precision (a view of loom's panels if the
        weight is held as them)."""
        return self.form.plain()

    def release_weight(self) -> None:
        """Free what the weight is made of beyond its parameters (a weight-update sleep;
        the next load fills it whole)."""
        self.form.release()

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None,
               float_output: bool = False) -> torch.Tensor:
        """``x W^T (+ bias)`` on this rank's weight, however it is held; with
        ``float_output``, float32 (the kernels' sums unrounded where they have them); plus
        the step's LoRA adapters on their rows."""
        y = self.form.apply(x, bias, float_output)
        if self.lora is not None:
            self.lora.add(x, y)
        return y


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
