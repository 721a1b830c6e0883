"""A model's forward recorded once per shape and replayed from C++: the native CPU path.

On the CPU every module of a bfloat16 model calls loom's kernels (``loom.kernels``) for
its work, with a few PyTorch ops between them: views, an allocation for a kernel to
write into, a dtype conversion. ``KernelReplay`` runs one eager forward under a
recorder that sees both, and keeps the flat list of kernel calls it made as a
``ReplayProgram`` (``kernels/csrc/replay.h``); later forwards of the same shape run that
list from C++, with no Python between the kernels (about 25 small ops per decoder
layer: ~1.1 ms of a 8.9 ms batch-1 decode step of SmolLM2), as a CUDA graph replays a
captured step. Nothing here or in C++ knows what a Llama, an ERNIE MoE or a Gemma layer
is: a module built from loom's kernels runs natively as it is written.

What a recording holds:

- **Inputs**, which change from one replay to the next: the forward's tensor
  arguments (token ids, positions) and the step's attention metadata tensors (slot
  mapping, query starts, sequence lengths, block tables; ``set_forward_context``).
- **Kernel calls**: every function ``loom.kernels`` binds with ``def_kernel`` (listed
  in its ``replay_kernels``; each tells the recorder of its calls, however the caller
  got hold of it), each argument a slot (an input, an earlier kernel's
  result) or a constant: a weight, a KV cache, a module's buffer, a number, a
  quantized weight's handle.
- **Temporaries**: what the forward allocated for kernels to write into
  (``torch.empty``) and the results of the ATen ops it ran (a dtype conversion, an
  elementwise add, an embedding's gather), placed in buffers planned once for the
  whole program (a buffer is reused once its last reader has run, so a program holds
  about one layer's temporaries, in blocks shared by all of this model's programs).
  Views of them are made once, at planning; views of inputs and of kernels' results
  at each replay.

A program is kept per shape: the inputs' shapes and dtypes (a block table's width
aside: kernels read it through its rows) and every Python value of the attention
metadata the forward read (``max_query_len``, say), checked before a replay. A forward
is recorded at its shape's second sighting (``RECORD_AFTER``), up to ``MAX_TOKENS``
tokens (longer steps spend their time in the matmuls, not in Python), and at most
``MAX_PROGRAMS`` are kept. A step whose rope computes cos and sin per token
(``rope_lengths``: dynamic NTK or longrope past the original context, layers/rotary.py)
runs the modules, neither recorded nor replayed.

The one refusal is the recorder's, said once per binding of weights and caches: the
forward called a PyTorch op with no native kernel (a float32 model's ``F.rms_norm``, an
activation loom has no kernel for), read a tensor's value into Python, or took a tensor
made outside it that is neither an input nor a module's weight or buffer. Then the
modules run as they are. ``LOOM_NATIVE_LAYERS=0`` turns replays off; a model split
over ranks (tensor parallel) is not replayed: its collectives are ``torch.distributed``
calls, which the recorder does not see.

Python side effects of a forward are not replayed: a module that counts its forwards
defines ``on_replay()``, which is called after each replay.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from loom.envs import settings
from loom.kernels import native_ops
from loom.model.attention.metadata import AttentionMetadata, get_forward_context, \
    set_forward_context

logger = logging.getLogger(__name__)

RECORD_AFTER = 1  # sightings of a shape before it is recorded (0: at the first)
MAX_TOKENS = 256
MAX_PROGRAMS = 64

# PyTorch ops by what a recording does with them
_METADATA = frozenset({
    "__get__", "dim", "size", "stride", "is_contiguous", "numel", "storage_offset",
    "element_size", "is_floating_point", "__len__", "ndimension", "nelement",
    "get_device", "is_inference", "untyped_storage", "data_ptr", "has_names",
    "is_complex"})
_DATA_DEPENDENT = frozenset({"item", "tolist", "__bool__", "__int__", "__float__",
                             "__index__", "numpy", "__array__", "__format__", "__repr__"})
_VIEWS = frozenset({"view", "__getitem__", "narrow", "split", "chunk", "unsqueeze",
                    "squeeze", "flatten", "unflatten", "transpose", "t", "permute", "expand",
                    "select", "view_as", "unbind", "detach", "as_strided", "movedim",
                    "swapaxes", "reshape", "split_with_sizes", "tensor_split"})
_CONVERSIONS = frozenset({"float", "to", "long", "int", "bfloat16", "half", "double",
                          "contiguous", "type_as", "clone"})
_ALLOCATIONS = frozenset({"empty", "empty_like", "new_empty", "empty_strided"})
_BINARY = {"add": "add_out", "__add__": "add_out", "__radd__": "add_out",
           "sub": "sub_out", "__sub__": "sub_out",
           "mul": "mul_out", "__mul__": "mul_out", "__rmul__": "mul_out"}
_IN_PLACE = {"add_": "add_", "__iadd__": "add_", "sub_": "sub_", "__isub__": "sub_",
             "mul_": "mul_", "__imul__": "mul_", "copy_": "copy"}


class Refusal(Exception):
    """The recorded forward did something a replay cannot: why, in a sentence."""


@dataclass(frozen=True)
class _Planned:
    """A tensor in a planned buffer: buffer ``index``, and its layout in it."""

    index: int
    dtype: torch.dtype
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int  # in elements


@dataclass
class _Buffer:
    nbytes: int
    first: int  # the step that allocated it
    last: int  # the last step that used it (or a view of it)


def _name(func: Any) -> str:
    return getattr(func, "__name__", None) or str(func)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, torch.Tensor)]
    return []


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _WatchedMetadata:
    """The step's attention metadata as the recorded forward sees it: each Python value
    it reads (not a tensor, not a method) is noted, to be checked before a replay."""

    def __init__(self, metadata: AttentionMetadata, reads: dict, group: int = 0) -> None:
        object.__setattr__(self, "_metadata", metadata)
        object.__setattr__(self, "_reads", reads)
        object.__setattr__(self, "_group", group)

    def for_group(self, group: int) -> Any:
        return (self if group == 0 else
                _WatchedMetadata(self._metadata.for_group(group), self._reads, group))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._metadata, name)
        if not isinstance(value, torch.Tensor) and not callable(value):
            self._reads[(self._group, name)] = _frozen(value)
        return value


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class _Recorder(TorchFunctionMode):
    """Watches one eager forward: the PyTorch ops (this mode) and loom's kernels (their
    wrappers call ``kernel``) it runs, as steps over slots, planned buffers and
    constants."""

    def __init__(self, inputs: list[torch.Tensor], block_tables: set[int],
                 persistent: Callable[[], set[int]]) -> None:
        super().__init__()
        self.keep: list[torch.Tensor] = list(inputs)  # each slot's tensor (ids stay unique)
        self.planned: list[torch.Tensor] = []  # alive while recording: storages unique
        self.slots = {id(tensor): index for index, tensor in enumerate(inputs)}
        self.num_inputs = len(inputs)
        self.block_tables = block_tables  # ids of the block-table inputs
        # storages of weights, buffers, KV caches: found again when a tensor is not in
        # them (a module may make one during the forward, a float32 copy of a weight)
        self._find_persistent = persistent
        self.persistent = persistent()
        self.buffers: list[_Buffer] = []
        self.buffer_of: dict[int, int] = {}  # storage -> planned buffer
        self.steps: list[tuple[str, list[Any], list[int]]] = []
        self.refusal: str | None = None

    # ---- tensors as a replay has them

    def _new_slot(self, tensor: torch.Tensor) -> int:
        index = len(self.keep)
        self.keep.append(tensor)
        self.slots[id(tensor)] = index
        return index

    def _plan(self, tensor: torch.Tensor) -> None:
        """``tensor`` was just allocated by the forward: a planned buffer from now on."""
        self.buffer_of[_storage(tensor)] = len(self.buffers)
        self.buffers.append(_Buffer(tensor.untyped_storage().nbytes(), len(self.steps),
                                    len(self.steps)))
        self.planned.append(tensor)

    def ref(self, tensor: torch.Tensor, where: str) -> Any:
        """``tensor`` as a step's argument: its slot, its planned place, or itself."""
        index = self.slots.get(id(tensor))
        if index is not None:
            return native_ops().ReplaySlot(index)
        buffer = self.buffer_of.get(_storage(tensor))
        if buffer is not None:
            self.buffers[buffer].last = len(self.steps)
            return _Planned(buffer, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                            tensor.storage_offset())
        if _storage(tensor) not in self.persistent:
            self.persistent = self._find_persistent()
        if _storage(tensor) in self.persistent:
            return tensor
        raise Refusal(f"{where} took a {tuple(tensor.shape)} {tensor.dtype} tensor made "
                      "outside the forward that is neither an input nor a module's weight, "
                      "buffer or KV cache")

    def arg(self, value: Any, where: str) -> Any:
        if isinstance(value, torch.Tensor):
            return self.ref(value, where)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            refs = [self.ref(v, where) if isinstance(v, torch.Tensor) else v for v in value]
            if any(isinstance(ref, native_ops().ReplaySlot) for ref in refs):
                raise Refusal(f"{where} took a list of tensors that change from step to step")
            return refs
        return value

    # ---- loom's kernels

    def kernel(self, name: str, args: tuple, result: Any) -> None:
        """The kernels tell this of each call (``set_replay_recorder``): its arguments
        in its parameters' order, its result."""
        if self.refusal is not None:
            return
        try:
            refs = [self.arg(value, f"kernel {name}") for value in args]
            outputs = [self._new_slot(tensor) for tensor in _tensors(result)]
            self.steps.append((name, refs, outputs))
        except Refusal as refusal:
            self.refusal = str(refusal)

    # ---- PyTorch's ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        if self.refusal is not None or name in _METADATA:
            return func(*args, **kwargs)
        if name in _DATA_DEPENDENT:
            self.refusal = (f"the forward read a tensor's value into Python (Tensor.{name}); "
                            "a replay cannot follow what it decides")
            return func(*args, **kwargs)
        result = func(*args, **kwargs)
        try:
            self._record(name, args, kwargs, result)
        except Refusal as refusal:
            self.refusal = str(refusal)
        return result

    def _record(self, name: str, args: tuple, kwargs: dict, result: Any) -> None:
        if name in _ALLOCATIONS:
            self._plan(result)
            return
        if name == "embedding":  # F.embedding(ids, weight): a gather of rows
            ids, weight = args[0], args[1]
            if ids.dim() != 1 or kwargs.get("max_norm") is not None:
                raise Refusal("the forward ran an embedding of ids that are not one row")
            self._result_from("index_select_out", result, [weight, 0, ids])
            return
        if name in _BINARY:
            if kwargs or len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
                raise Refusal(f"the forward ran torch.{name} on a number (no native kernel)")
            self._result_from(_BINARY[name], result, list(args))
            return
        if name in _IN_PLACE:
            if kwargs or len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args):
                raise Refusal(f"the forward ran torch.{name} on a number (no native kernel)")
            self.steps.append((f"aten.{_IN_PLACE[name]}",
                               [self.ref(args[0], name), self.ref(args[1], name)], []))
            return
        if name in _VIEWS or name in _CONVERSIONS:
            source = args[0]
            for out in _tensors(result):
                self._derived(name, source, out)
            return
        raise Refusal(f"the forward called torch.{name}, which has no native kernel")

    def _result_from(self, op: str, result: torch.Tensor, operands: list[Any]) -> None:
        """``result``, just allocated by an ATen op: planned, and written at replay by
        ``aten.<op>(result, *operands)``."""
        refs = [self.arg(value, op) for value in operands]
        self._plan(result)
        self.steps.append((f"aten.{op}", [self.ref(result, op), *refs], []))

    def _derived(self, name: str, source: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` from ``source`` by a view or a conversion."""
        if out is source or id(out) in self.slots:
            return
        if out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
            index = self.slots.get(id(source))
            if index is None:  # a view of a planned buffer or a weight: resolved by storage
                self.ref(source, name)
                return
            if id(source) in self.block_tables:
                raise Refusal("the forward took a view of a block table, whose width changes "
                              "from step to step")
            step = ("aten.as_strided",
                    [native_ops().ReplaySlot(index), list(out.shape), list(out.stride()),
                     out.storage_offset() - source.storage_offset()], [])
            step[2].append(self._new_slot(out))
            self.steps.append(step)
            return
        if name not in _CONVERSIONS and name != "reshape" or out.numel() != source.numel():
            raise Refusal(f"the forward ran torch.{name} as a gather (no native kernel)")
        # a copy (a conversion, a reshape that could not view): planned, then copied into
        source_ref = self.ref(source, name)
        self._plan(out)
        target = out if out.shape == source.shape else out.view(source.shape)
        self.steps.append(("aten.copy", [self.ref(target, name), source_ref], []))


class _KernelCalls:
    """loom's kernels tell ``recorder`` of each call for the length of a ``with`` block."""

    def __init__(self, recorder: _Recorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> None:
        native_ops().set_replay_recorder(self.recorder.kernel)

    def __exit__(self, *exc: Any) -> None:
        native_ops().set_replay_recorder(None)


_TENSOR_FIELDS = tuple(f.name for f in fields(AttentionMetadata)
                       if str(f.type).startswith("torch.Tensor"))


def _metadata_inputs(metadata: AttentionMetadata) -> list[tuple[str, torch.Tensor]]:
    """The step's tensors in the metadata, every KV cache group's, by name (an optional
    one that is None is not an input: the shape key then differs)."""
    named = [(name, value) for name in _TENSOR_FIELDS
             if (value := getattr(metadata, name)) is not None]
    for group, meta in enumerate(metadata.group_metadata, start=1):
        named += [(f"{group}.{name}", value) for name in _TENSOR_FIELDS
                  if (value := getattr(meta, name)) is not None]
    return named


def _shape_key(args: tuple, metadata: AttentionMetadata | None) -> tuple:
    inputs = [("arg", a) for a in args]
    if metadata is not None:
        inputs += _metadata_inputs(metadata)
    key = []
    for name, tensor in inputs:
        if name.endswith("block_table"):
            key.append((name, tensor.dtype, tensor.shape[0]))
        else:
            key.append((name, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())))
    return tuple(key)


@dataclass
class _Program:
    program: Any  # the kernels' ReplayProgram
    plan: Any  # its _Plan, to make it again on grown blocks
    inference: bool  # recorded in inference mode (its blocks are that mode's)
    reads: dict  # (group, name) -> the value the recording read
    single: bool  # the forward returned one tensor (else a tuple)

    def matches(self, metadata: AttentionMetadata | None) -> bool:
        return all(metadata is not None and
                   _frozen(getattr(metadata.for_group(group), name)) == value
                   for (group, name), value in self.reads.items())


@dataclass
class ReplayStats:
    recorded: int = 0
    replayed: int = 0
    eager: int = 0
    steps: dict = field(default_factory=dict)  # shape key's tokens -> steps per replay


class KernelReplay:
    """``forward`` recorded per shape and replayed natively (see the module's doc);
    installed as a model's forward by ``install``."""

    def __init__(self, forward: Callable, model: nn.Module) -> None:
        self.forward = forward
        self.model = model
        self.stats = ReplayStats()
        self.refusal: str | None = None  # said once; cleared with the programs
        self._programs: OrderedDict[tuple, list[_Program]] = OrderedDict()
        self._sightings: OrderedDict[tuple, int] = OrderedDict()
        # planned buffers, shared by the programs: one set for forwards in inference
        # mode, one outside it (an inference tensor is not written outside it)
        self._blocks: dict[bool, list[torch.Tensor]] = {False: [], True: []}
        self._announced: str | None = None
        self._on_replay = [module.on_replay for module in model.modules()
                           if callable(getattr(module, "on_replay", None))]

    def clear(self) -> None:
        """Weights re-packed or KV caches re-bound: record again."""
        self._programs.clear()
        self._sightings.clear()
        self._blocks = {False: [], True: []}
        self.refusal = None

    @property
    def num_programs(self) -> int:
        return sum(len(programs) for programs in self._programs.values())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (kwargs or self.refusal is not None or torch.is_grad_enabled()
                or not args or not all(isinstance(a, torch.Tensor) for a in args)
                or args[0].device.type != "cpu" or args[0].shape[0] > MAX_TOKENS):
            self.stats.eager += 1
            return self.forward(*args, **kwargs)
        try:
            metadata = get_forward_context()
        except RuntimeError:
            metadata = None
        if metadata is not None and metadata.rope_lengths is not None:
            # a length-scaled rope computes this step's cos and sin (layers/rotary.py)
            self.stats.eager += 1
            return self.forward(*args)
        key = (torch.is_inference_mode_enabled(), _shape_key(args, metadata))
        programs = self._programs.get(key)
        if programs is not None:
            for program in programs:
                if program.matches(metadata):
                    self._programs.move_to_end(key)
                    return self._replay(program, args, metadata)
        seen = self._sightings.pop(key, 0)
        self._sightings[key] = seen + 1
        while len(self._sightings) > 4 * MAX_PROGRAMS:
            self._sightings.popitem(last=False)
        if seen < RECORD_AFTER:
            self.stats.eager += 1
            return self.forward(*args)
        return self._record(key, args, metadata)

    def _replay(self, program: _Program, args: tuple,
                metadata: AttentionMetadata | None) -> Any:
        inputs = list(args)
        if metadata is not None:
            inputs += [tensor for _, tensor in _metadata_inputs(metadata)]
        outputs = program.program.run(inputs)
        for hook in self._on_replay:
            hook()
        self.stats.replayed += 1
        return outputs[0] if program.single else tuple(outputs)

    def _record(self, key: tuple, args: tuple, metadata: AttentionMetadata | None) -> Any:
        named = _metadata_inputs(metadata) if metadata is not None else []
        inputs = [*args, *(tensor for _, tensor in named)]
        block_tables = {id(tensor) for name, tensor in named if name.endswith("block_table")}
        recorder = _Recorder(inputs, block_tables, self._persistent)
        reads: dict = {}
        watched = _WatchedMetadata(metadata, reads) if metadata is not None else None
        with _KernelCalls(recorder), recorder, set_forward_context(watched):
            result = self.forward(*args)
        self.stats.eager += 1
        try:
            if recorder.refusal is not None:
                raise Refusal(recorder.refusal)
            outputs = [recorder.ref(tensor, "the forward's result") for tensor in _tensors(result)]
            if not outputs or (not isinstance(result, torch.Tensor)
                               and len(outputs) != len(result)):
                raise Refusal("the forward returned something other than tensors")
            plan = self._build(recorder, outputs)
        except Refusal as refusal:
            self.refusal = str(refusal)
            self._announce(f"forward: PyTorch modules, as {self.refusal}")
            return result
        program = plan.program(self._blocks_for(plan))
        entry = _Program(program, plan, torch.is_inference_mode_enabled(), reads,
                         isinstance(result, torch.Tensor))
        self._programs.setdefault(key, []).append(entry)
        while self.num_programs > MAX_PROGRAMS:
            self._programs.popitem(last=False)
        self.stats.recorded += 1
        self.stats.steps[args[0].shape[0]] = program.num_steps
        self._announce("forward: replayed from loom's native kernels (recorded per shape)")
        return result

    def _announce(self, path: str) -> None:
        if path != self._announced:
            logger.info("%s", path)
            self._announced = path

    def _persistent(self) -> set[int]:
        """Storages a recording may hold as constants: the model's parameters and
        buffers, and every tensor its modules hold as attributes (KV caches, counters)."""
        storages = {_storage(t) for t in (*self.model.parameters(), *self.model.buffers())}
        for module in self.model.modules():
            for value in vars(module).values():
                if isinstance(value, torch.Tensor):
                    storages.add(_storage(value))
        return storages

    def _build(self, recorder: _Recorder, outputs: list[Any]) -> _Plan:
        """The recorder's steps over planned buffers, each buffer placed in a block
        (reused once its last step has run)."""
        last_step = len(recorder.steps)
        for ref in outputs:
            if isinstance(ref, _Planned):
                recorder.buffers[ref.index].last = last_step
        sizes: list[int] = []  # each block's size
        place: list[int] = []  # each buffer's block
        free: list[int] = []  # blocks free now
        ending: list[tuple[int, int]] = []  # (last step, block) of buffers in use
        for buffer in recorder.buffers:
            for done in [e for e in ending if e[0] < buffer.first]:
                ending.remove(done)
                free.append(done[1])
            fits = sorted((sizes[b], b) for b in free if sizes[b] >= buffer.nbytes)
            if fits:
                block = fits[0][1]
                free.remove(block)
            else:
                block = len(sizes)
                sizes.append(buffer.nbytes)
            place.append(block)
            ending.append((buffer.last, block))
        return _Plan(recorder.steps, outputs, place, sizes, len(recorder.keep),
                     recorder.num_inputs)

    def _blocks_for(self, plan: _Plan) -> list[torch.Tensor]:
        """This mode's blocks, grown to hold ``plan``'s; the programs made on a block
        that grows are made again on the new one."""
        blocks = self._blocks[torch.is_inference_mode_enabled()]
        grown = False
        for block, size in enumerate(plan.sizes):
            size = -(-size // 64) * 64  # any dtype's view of a block fits whole
            if block >= len(blocks):
                blocks.append(torch.empty(size, dtype=torch.uint8))
            elif blocks[block].numel() < size:
                grown = True
                blocks[block] = torch.empty(max(size, 2 * blocks[block].numel()),
                                            dtype=torch.uint8)
        if grown:
            for programs in self._programs.values():
                for entry in programs:
                    if entry.inference == torch.is_inference_mode_enabled():
                        entry.program = entry.plan.program(blocks)
        return blocks


@dataclass
class _Plan:
    """A recording with its buffers placed in blocks: made a ``ReplayProgram`` on the
    blocks at hand (again whenever a block grows)."""

    steps: list[tuple[str, list[Any], list[int]]]
    outputs: list[Any]
    place: list[int]  # each planned buffer's block
    sizes: list[int]  # each block's bytes
    num_slots: int
    num_inputs: int

    def program(self, blocks: list[torch.Tensor]) -> Any:
        def placed(value: Any) -> Any:
            if isinstance(value, _Planned):
                block = blocks[self.place[value.index]].view(value.dtype)
                return block.as_strided(value.sizes, value.strides, value.offset)
            if isinstance(value, list):
                return [placed(v) for v in value]
            return value

        steps = [(name, [placed(a) for a in args], outs) for name, args, outs in self.steps]
        return native_ops().ReplayProgram(self.num_slots, self.num_inputs, steps,
                                          [placed(ref) for ref in self.outputs])


def install(model: nn.Module, num_ranks: int = 1) -> KernelReplay | None:
    """Replay ``model``'s forward natively where loom's kernels run (the CPU with the
    kernels built; ``LOOM_NATIVE_LAYERS`` on; one rank: a collective between ranks is a
    ``torch.distributed`` call, which a recording would not see); None elsewhere."""
    ops = native_ops()
    if (ops is None or not hasattr(ops, "ReplayProgram") or not settings().native_layers
            or num_ranks != 1):
        return None
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return None
    if device.type != "cpu":
        return None
    replay = KernelReplay(model.forward, model)
    model.kernel_replay = replay
    model.forward = replay
    return replay


def forget_recordings(model: nn.Module) -> None:
    """The model's weights or KV caches changed: its recordings hold the old ones."""
    replay = getattr(model, "kernel_replay", None)
    if replay is not None:
        replay.clear()
