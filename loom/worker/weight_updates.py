"""A rank's side of weights that change while serving: update, clear, sleep and wake.

Every change moves the rank through the seed's weights states (``WeightsStatus``,
written to the rank's ``weights_status`` signal as it goes):

    update_weights    NORMAL -> CLEARING -> CLEARED -> UPDATING -> NORMAL
    sleep(level=2)    NORMAL -> CLEARING -> CLEARED         (weights freed)
    wake_up / update  CLEARED -> UPDATING -> NORMAL          (weights loaded again)

An update is checked whole before any weight changes: the new tensors' names and
shapes go through the model's own ``load_weights`` on a meta-device twin of the model
(the same name mapping and ``weight_loader`` shard checks, no memory), and every rank
must pass (a MIN over the TP group) before any rank copies. A failed check raises
``ValueError`` (or ``FileNotFoundError``) naming the problem and leaves the weights
serving as they were. Then the real copy goes through ``load_weights`` (each rank takes
its shard; a wint8 layer re-quantizes what it is given) and every module's
``process_weights_after_loading`` runs again, as after the first load: CPU linears pack
their new weight, and the forwards recorded on the old ones are recorded again.

A copy that fails after the checks passed (a source that breaks mid-read: a truncated
file, a trainer's segment gone) would leave old and new weights mixed; no copy of the old
ones is kept to roll back to (it would double the weights' memory), so every rank frees
its weights instead (CLEARED, as ``sleep(2)``) and raises ``WeightsLostError``: the
engine holds requests until an update succeeds or ``wake_up`` reloads the last
checkpoint loaded from disk. Never a mix of weights in one forward pass.

A LoRA adapter's weights change on their own (``update_lora``): checked on every rank,
then written into the adapter's slot; the base weights keep their state, and requests
on the base and on other adapters are not held.

Sources: a checkpoint directory of safetensors, a ``.gguf`` file, an ipc manifest
(``loom.weight_sync``: tensors mapped from the trainer's shared memory), or tensors
handed in by a caller in the same process.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from loom.errors import WeightsLostError
from loom.ipc.signal import WeightsStatus
from loom.model.kernel_replay import forget_recordings
from loom.worker import memory

logger = logging.getLogger(__name__)

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightUpdater:
    """Owns one rank's weights state. ``on_status`` publishes each state (the worker
    process writes it to the shared-memory signal); ``history`` keeps every state
    entered, for tests and logs."""

    def __init__(self, worker, on_status: Callable[[WeightsStatus], None] | None = None) -> None:
        self.worker = worker
        self.on_status = on_status
        self.status = WeightsStatus.NORMAL
        self.history: list[int] = [int(WeightsStatus.NORMAL)]
        self.source = worker.config.model.model  # what wake_up reloads from
        self.freed_params: dict[str, tuple[torch.Size, torch.dtype, torch.device]] | None = None
        self.kv_cache_freed = False

    @property
    def runner(self):
        return self.worker.model_runner

    @property
    def model(self) -> nn.Module:
        return self.runner.model

    def _set(self, status: WeightsStatus) -> None:
        self.status = status
        self.history.append(int(status))
        if self.on_status is not None:
            self.on_status(status)

    # ----------------------------------------------------------------- updates

    def update_from_path(self, path: str | None) -> dict[str, Any]:
        """Load every weight from ``path`` (None: the last checkpoint loaded)."""
        path = path or self.source
        with ExitStack() as stack:
            try:
                named, meta, kind = open_source(path, self.runner.hf_config, stack,
                                                self.worker.config.model.quantization)
            except (ValueError, FileNotFoundError) as error:  # every rank must hear of it
                return self._update(None, None, False, path, refused=error)
            result = self._update(named, meta, require_all=kind != "ipc-partial",
                                  description=f"{kind} {path}")
        if kind in ("safetensors", "gguf"):
            self.source = path
        return result

    def update_from_tensors(self, named_tensors: NamedTensors) -> dict[str, Any]:
        """Load the given (checkpoint name, tensor) pairs, any subset of the weights."""
        tensors = list(named_tensors)
        return self._update(lambda: iter(tensors), lambda: _meta_of(tensors),
                            require_all=False, description=f"{len(tensors)} tensors")

    def update_lora(self, name: str, path: str) -> dict[str, Any]:
        """Serve LoRA adapter ``name`` from ``path`` (loom/lora.py): a new adapter, or new
        weights for one served already, written into its slot in place. The base weights
        and their state, and every other adapter, are untouched, so nothing is held or
        drained: requests on other adapters run on, and ``name``'s take the new weights
        from the next step (the caller gives its later requests a new load id, so none
        reuses the old weights' prefix blocks). Checked on every rank (read and fitted to
        the base) before any rank changes anything; a refusal raises ValueError naming
        the adapter, and the old one keeps serving."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        started = time.perf_counter()
        adapter = error = None
        try:
            adapter = lora.read(name, path)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            error = exc
        if not self.worker.tp_group.all_reduce_min(int(error is None)):
            if isinstance(error, ValueError):  # AdapterError: a ValueError by any executor
                raise ValueError(str(error)) from None
            if error is not None:
                raise error
            raise ValueError(f"LoRA adapter {name!r}: another rank refused {path} (its "
                               "error is in its log); nothing changed")
        lora.commit(name, path, adapter)
        return {"lora_name": name, "seconds": time.perf_counter() - started}

    def _update(self, named: Callable[[], Iterator] | None, meta: Callable[[], Iterator] | None,
                require_all: bool, description: str,
                refused: Exception | None = None) -> dict[str, Any]:
        started = time.perf_counter()
        refill = self.freed_params is not None
        error = refused
        if error is None:
            try:
                self.check(meta(), require_all=require_all or refill)
            except (ValueError, FileNotFoundError) as exc:
                error = exc
        tp_group = self.worker.tp_group
        if not tp_group.all_reduce_min(int(error is None)):
            if error is not None:
                raise error
            raise ValueError("another rank refused this weight update (its error is in its "
                             "log); the weights are unchanged")
        if not refill:
            # In place: the weights stay allocated; what was planned on them goes. Packed
            # copies are replaced layer by layer after the load (a peak of one layer's).
            self._set(WeightsStatus.CLEARING)
            self._invalidate_plans()
            self._set(WeightsStatus.CLEARED)
        self._set(WeightsStatus.UPDATING)
        if refill:
            self._reallocate_params()
        copy_error: Exception | None = None
        try:
            with torch.no_grad():
                loaded = self.model.load_weights(named())
        except Exception as exc:  # noqa: BLE001 - any failure mid-copy leaves a mix
            copy_error = exc
        if not tp_group.all_reduce_min(int(copy_error is None)):
            self.clear()
            reason = (f"{type(copy_error).__name__}: {copy_error}" if copy_error is not None
                      else "another rank failed (its error is in its log)")
            raise WeightsLostError(
                f"the weight update from {description} failed while copying ({reason}); "
                f"the half-written weights were freed on every rank: requests are held until "
                f"an update succeeds, or wake_up reloads {self.source}")
        self._derive_state()
        tp_group.barrier()
        self._set(WeightsStatus.NORMAL)
        seconds = time.perf_counter() - started
        if tp_group.rank == 0:
            logger.info("weights updated from %s: %d parameters in %.3fs", description,
                        len(loaded), seconds)
        return {"num_parameters": len(loaded), "seconds": seconds}

    def check(self, meta_weights: Iterator[tuple[str, torch.Tensor]], require_all: bool) -> None:
        """Run the new weights' names and shapes through ``load_weights`` on a meta twin
        of the model: the errors a real load would raise, before anything changes."""
        twin = meta_twin(self.model, self.runner.hf_config, self.worker.tp_group,
                         getattr(self.worker.config.parallel, "expert_parallel_size", 1))
        current = [None]

        def named(weights):
            for name, tensor in weights:
                current[0] = f"{name} {tuple(tensor.shape)}"
                yield name, tensor

        shards = _record_shards(twin)
        try:
            loaded = twin.load_weights(named(meta_weights))
        except (ValueError, RuntimeError, IndexError) as exc:  # a slice past the tensor's end
            raise ValueError(f"weight update refused, the weights are unchanged: tensor "
                             f"{current[0]} does not fit: {exc}") from None
        if require_all:
            missing = sorted(set(dict(twin.named_parameters())) - loaded)
            missing += _missing_shards(twin, shards)
            if missing:
                raise ValueError(f"weight update refused, the weights are unchanged: the new "
                                 f"weights lack {len(missing)} parameters, e.g. {missing[:3]}")

    # ----------------------------------------------------------------- clear, sleep, wake

    def clear(self) -> None:
        """Free the weights (NORMAL -> CLEARING -> CLEARED); an update or wake_up refills."""
        if self.freed_params is not None:
            return
        self._set(WeightsStatus.CLEARING)
        self._drop_derived_state()
        self.freed_params = {}
        for name, param in _unique_params(self.model):
            self.freed_params[name] = (param.shape, param.dtype, param.device)
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._release_memory()
        self._set(WeightsStatus.CLEARED)

    def free_kv_cache(self) -> int:
        """Drop the KV cache; returns its bytes. ``wake_up`` allocates it again."""
        if self.kv_cache_freed:
            return 0
        thread = getattr(self.worker, "populate_thread", None)
        if thread is not None:
            thread.join()  # it writes into the cache's pages
            self.worker.populate_thread = None
        runner = self.runner
        storage = runner.kv_cache_storage
        nbytes = storage.numel() * storage.element_size()
        runner.kv_cache_storage = None
        runner.kv_caches = []
        for attention in self.model.attention_layers:
            attention.kv_cache = None
        self._invalidate_plans()
        del storage
        self.kv_cache_freed = True
        self._release_memory()
        return nbytes

    def sleep(self, level: int) -> dict[str, Any]:
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (free the KV "
                             f"cache and the weights), got {level}")
        kv_bytes = self.free_kv_cache()
        if level == 2:
            self.clear()
        return {"kv_cache_bytes_freed": kv_bytes, "level": level}

    def wake_up(self) -> dict[str, Any]:
        result: dict[str, Any] = {}
        if self.freed_params is not None:
            result["weights"] = self.update_from_path(self.source)
        if self.kv_cache_freed:
            self.worker.initialize_kv_cache(self.worker.num_blocks)
            self.kv_cache_freed = False
        return result

    # ----------------------------------------------------------------- internals

    def _drop_derived_state(self) -> None:
        """What holds the weights' bytes beside the parameters, before they are freed: a
        layer's ``release_weight()`` (its weight form's references: a quantized linear's
        kernel layout, packed copies), an LM head's float32 copy, the form of a table
        hung on its parameter (quantized, or the LM head's panels); and the native
        stack's plan."""
        for module in self.model.modules():
            release = getattr(module, "release_weight", None)
            if release is not None:
                release()
            if getattr(module, "float32_weight", None) is not None:
                module.float32_weight = None
        for param in self.model.parameters():
            form = getattr(param, "form", None)  # an embedding table's, a tied head's
            if form is not None:
                form.release()
        self._invalidate_plans()

    def _derive_state(self) -> None:
        """The loader's post-load pass again (model_loader.load_model): pack, re-plan."""
        for module in self.model.modules():
            hook = getattr(module, "process_weights_after_loading", None)
            if hook is not None:
                hook()
        self._invalidate_plans()
        self._release_memory()

    def _invalidate_plans(self) -> None:
        """Drop what was planned on the weights and the KV cache: the recorded forwards
        (kernel_replay.py) and CUDA graphs, which hold their addresses."""
        forget_recordings(self.model)
        self.runner.drop_cuda_graphs()
        if getattr(self.worker, "kv_tier", None) is not None:
            self.worker.kv_tier.invalidate()  # its records hold the old weights' K/V

    def _reallocate_params(self) -> None:
        params = dict(_unique_params(self.model))
        for name, (shape, dtype, device) in self.freed_params.items():
            params[name].data = torch.zeros(shape, dtype=dtype, device=device)
        self.freed_params = None

    def _release_memory(self) -> None:
        if self.worker.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            memory.release_freed_memory()


# ----------------------------------------------------------------- sources


def _check_not_stored_quantized(path: str) -> None:
    """New weights stored quantized (AWQ, GPTQ, ...) fail naming the method, not as
    parameters the checkpoint lacks."""
    from loom.config_checks import check_stored_quantization

    config_path = os.path.join(path, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except FileNotFoundError:
        config = {}
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read {config_path}: {error}") from None
    check_stored_quantization(config if isinstance(config, dict) else {}, path,
                              what=f"the checkpoint at {path}")


def open_source(path: str, hf_config: Any, stack: ExitStack, quantization: str = "auto"
                ) -> tuple[Callable[[], Iterator], Callable[[], Iterator], str]:
    """(real tensors, meta tensors, kind) for the weights at ``path``: a directory of
    safetensors, a .gguf file, or an ipc manifest (file or its directory)."""
    from loom.model.loader.model_loader import is_gguf
    from loom.model.loader.safetensors_loader import safetensors_weights_iterator
    from loom.weight_sync import mapped_weights, read_manifest

    manifest = read_manifest(path)
    if manifest is not None:
        views = stack.enter_context(mapped_weights(manifest))
        kind = "ipc" if not manifest.get("partial") else "ipc-partial"
        return (lambda: iter(views)), (lambda: _meta_of(views)), kind
    if is_gguf(path):
        return _gguf_weights(path, hf_config, quantization), lambda: _gguf_meta(path), "gguf"
    if os.path.isdir(path) and glob.glob(os.path.join(path, "*.safetensors")):
        _check_not_stored_quantized(path)
        return (lambda: safetensors_weights_iterator(path),
                lambda: _safetensors_meta(path), "safetensors")
    if os.path.isdir(path):
        raise FileNotFoundError(f"no *.safetensors files (and no loom ipc manifest) in {path}")
    raise FileNotFoundError(f"no weights at {path!r}: give a checkpoint directory of "
                            "*.safetensors, a .gguf file, or a loom ipc manifest "
                            "(loom.weight_sync.WeightPublisher)")


def _gguf_weights(path: str, hf_config: Any, quantization: str) -> Callable[[], Iterator]:
    """The GGUF's tensors as the loader reads them at start-up (model_loader.load_model):
    linear weights kept quantized where the loader keeps them."""
    import inspect

    from loom.model.loader.gguf_loader import gguf_weights_iterator

    if "keep_quantized" in inspect.signature(gguf_weights_iterator).parameters:
        return lambda: gguf_weights_iterator(path, hf_config,
                                             keep_quantized=quantization == "auto")
    return lambda: gguf_weights_iterator(path, hf_config)


def _gguf_meta(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Names and shapes from the GGUF header (what dequantizing gives); no data read."""
    from loom.model.loader.gguf_loader import gguf_to_hf_name, open_gguf

    for info in open_gguf(path).tensors.values():
        hf_name = gguf_to_hf_name(info.name)
        if hf_name is not None:
            yield hf_name, torch.empty(tuple(info.shape), device="meta")


def _meta_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in tensors:
        yield name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                       "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                       "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool}


def _safetensors_meta(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Names and shapes from the files' headers; no tensor data is read."""
    from safetensors import safe_open

    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                dtype = _SAFETENSORS_DTYPES.get(tensor_slice.get_dtype(), torch.float32)
                yield name, torch.empty(tensor_slice.get_shape(), dtype=dtype, device="meta")


# ----------------------------------------------------------------- the model


def model_expert_parallel(model: nn.Module) -> Any:
    """The EP group the model's MoE layers were built with (EPLB's slots too), or None."""
    from loom.model.layers.fused_moe import FusedMoE

    return next((m.expert_parallel for m in model.modules() if isinstance(m, FusedMoE)), None)


def meta_twin(model: nn.Module, hf_config: Any, tp_group, expert_parallel_size: int = 1
              ) -> nn.Module:
    """The model's architecture on the meta device, sharded as the model is (TP, and EP
    for MoE experts) but unquantized: its parameters have the shapes the checkpoint's
    shards load into, and cost no memory."""
    import inspect

    kwargs: dict[str, Any] = {"attention_backend": "torch"}
    if "expert_parallel" in inspect.signature(type(model)).parameters:
        from loom.distributed.parallel_state import across_replicas, expert_parallel_group

        kwargs["expert_parallel"] = model_expert_parallel(model) or expert_parallel_group(
            tp_group, expert_parallel_size, across_replicas())
    with torch.device("meta"):
        return type(model)(hf_config, tp_group, **kwargs)


def _record_shards(model: nn.Module) -> dict[str, set]:
    """Wrap each parameter's weight_loader to record the shard ids it is given."""
    from loom.model.layers.linear import default_weight_loader

    shards: dict[str, set] = {}
    for name, param in model.named_parameters():
        loader = getattr(param, "weight_loader", default_weight_loader)

        def recording(p, loaded_weight, shard_id=None, _name=name, _loader=loader):
            shards.setdefault(_name, set()).add(shard_id)
            return _loader(p, loaded_weight, shard_id)

        param.weight_loader = recording
    return shards


def _missing_shards(model: nn.Module, shards: dict[str, set]) -> list[str]:
    """Fused parameters (``packed_modules_mapping``: q, k, v -> qkv_proj) that were given
    only some of their parts, as "param[shard]"."""
    parts: dict[str, set] = {}
    for packed_name, shard_id in getattr(model, "packed_modules_mapping", {}).values():
        parts.setdefault(packed_name, set()).add(shard_id)
    missing = []
    for name, given in shards.items():
        for packed_name, expected in parts.items():
            if f".{packed_name}." in name and None not in given:  # given by parts
                missing += [f"{name}[{shard}]" for shard in sorted(expected - given, key=str)]
    return missing


def _unique_params(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Each parameter once (a tied LM head is the embedding's)."""
    yield from model.named_parameters()  # named_parameters already skips duplicates
