"""Worker: one device rank's model, KV cache and step execution.

The life cycle methods are called in order by whoever owns the worker: in-process
by ``UniProcExecutor``, or by ``worker_process.run_worker_proc`` in its own process.

    init_device -> load_model -> determine_num_blocks -> initialize_kv_cache
    -> warm_up -> execute_model ...
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from loom.config import EngineConfig
from loom.core.wire import ModelRunnerOutput, NewRequestData, SchedulerOutput
from loom.distributed.parallel_state import SINGLE, TPGroup, across_replicas
from loom.core.kv_sizing import blocks_per_sequence, lean_cpu_kv_cache_bytes
from loom.progress import progress
from loom.sampling_params import SamplingParams
from loom.worker import memory
from loom.worker.memory import activation_bytes_estimate
from loom.worker.model_runner import ModelRunner
from loom.worker.weight_updates import WeightUpdater

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, tp_group: TPGroup = SINGLE) -> None:
        self.config = config
        self.rank = rank
        self.tp_group = tp_group
        self.model_runner: ModelRunner | None = None
        self.kv_connector = None  # prefill/decode disaggregation (init_kv_connector)
        self.kv_segment = None  # the KV cache's shared-memory segment (kv_transport shm)
        self.kv_tier = None  # the KV offload tier's half on this rank (init_kv_tier)
        self.weights = WeightUpdater(self)  # update, clear, sleep, wake (weight_updates.py)

    def init_device(self) -> None:
        if self.config.device == "cuda":
            # experts across replicas: one NCCL group over every replica's ranks, each
            # on a GPU of its own (rank dp_rank * TP + tp_rank)
            across = across_replicas()
            rank = across.rank if across is not None else self.rank
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            # Ranks on one host share its memory; this process's share, counted before
            # it loads anything (what it already holds is its own).
            share = self.config.parallel.ranks_per_node
            self.cpu_total_memory = (memory.cpu_available_memory() // share
                                     + memory.process_rss())
        torch.manual_seed(self.config.model.seed)
        self.model_runner = ModelRunner(self.config, self.device, self.tp_group)

    def load_model(self) -> None:
        if self.device.type == "cpu":
            from loom.kernels import native_ops

            native_ops()  # reports a first-use build itself
        model = self.config.model.model
        if self.rank == 0:
            size = os.path.getsize(model) if os.path.isfile(model) else None
            progress(f"reading weights from {os.path.basename(model.rstrip('/'))}"
                     + (f" ({size / 1e6:,.0f} MB)" if size else "") + " ...")
        started = time.monotonic()
        self.model_runner.load_model()
        if self.rank == 0:
            from loom.model.loader.model_loader import (describe_weight_bytes,
                                                        weight_bytes_by_dtype)

            held = describe_weight_bytes(weight_bytes_by_dtype(self.model_runner.model))
            progress(f"weights read in {time.monotonic() - started:.1f} s; resident"
                     f"{' per rank' if self.tp_group.world_size > 1 else ''}: {held}")
        if self.device.type == "cpu":
            memory.release_freed_memory()

    def determine_num_blocks(self) -> int:
        """How many KV blocks every rank can hold (the minimum over ranks).

        ``num_gpu_blocks_override`` wins, then ``kv_cache_memory_bytes``, then a given
        ``memory_utilization``: profile, run the largest step, measure the peak, and
        give the KV cache

            total_memory * memory_utilization - memory after loading - activation peak

        (on CUDA, less what CUDA graphs will hold: ``cuda_graphs_memory_reserve``)
        where total_memory is the device's (CUDA) or this rank's share of the memory
        available to the process when it started (CPU). None of them given: on CUDA
        the same with DEFAULT_GPU_MEMORY_UTILIZATION; on the CPU the lean default
        (``lean_cpu_kv_cache_bytes``), no profiling. A CPU budget must fit in the
        memory available now, with room for the steps' activations, or start-up fails.
        """
        cache = self.config.cache
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if bytes_per_block == 0:  # an encoder: no KV cache, blocks only count tokens
            return (self.config.scheduler.max_num_seqs
                    * blocks_per_sequence(self.config, self.model_runner.kv_cache_groups.windows))
        if cache.kv_cache_memory_bytes is not None:
            budget, source = cache.kv_cache_memory_bytes, "--kv-cache-memory"
            self._check_cpu_memory(budget, "--kv-cache-memory")
        elif cache.memory_utilization is None and self.device.type == "cpu":
            budget, source = self._lean_cpu_budget(bytes_per_block), "the CPU default"
        else:
            budget, source = self._profile_kv_budget(), "profiling"
        # Experts across replicas: every replica the same blocks, so each runs the same
        # start-up steps (warm-up lends blocks), whose all-to-alls all ranks enter.
        group = across_replicas() or self.tp_group
        num_blocks = group.all_reduce_min(max(0, budget // bytes_per_block))
        logger.debug("rank %d: KV cache of %d blocks (%.1f MiB) from %s", self.rank,
                    num_blocks, num_blocks * bytes_per_block / 2**20, source)
        return num_blocks

    def _lean_cpu_budget(self, bytes_per_block: int) -> int:
        """The lean default, shrunk to the memory available now if that is less, but
        never below one max_model_len sequence (then start-up fails naming the knobs)."""
        groups = self.model_runner.kv_cache_groups.windows
        wanted = lean_cpu_kv_cache_bytes(self.config, bytes_per_block, groups)
        available, reserve = self._cpu_memory_available(), self._activation_reserve()
        if wanted + reserve <= available:
            return wanted
        one_sequence = blocks_per_sequence(self.config, groups)
        self._check_cpu_memory(one_sequence * bytes_per_block, "--max-model-len")
        logger.warning("rank %d: %.2f GiB of memory available; the KV cache gets %.2f GiB "
                       "instead of %.2f GiB", self.rank, available / 2**30,
                       (available - reserve) / 2**30, wanted / 2**30)
        return available - reserve

    def _check_cpu_memory(self, kv_bytes: int, knob: str) -> None:
        """Fail, naming ``knob``, if ``kv_bytes`` of KV cache and the steps' activations
        would not fit in the memory available to this rank now (CPU only)."""
        if self.device.type != "cpu":
            return
        available, reserve = self._cpu_memory_available(), self._activation_reserve()
        if kv_bytes + reserve > available:
            raise ValueError(
                f"a KV cache of {kv_bytes / 2**30:.2f} GiB and about {reserve / 2**30:.2f} GiB "
                f"for activations need more than the {available / 2**30:.2f} GiB of memory "
                f"available; lower {knob} (or --max-num-batched-tokens), or free memory")

    def _cpu_memory_available(self) -> int:
        return memory.cpu_available_memory() // self.config.parallel.ranks_per_node

    def _activation_reserve(self) -> int:
        return activation_bytes_estimate(self.model_runner.hf_config, self.config)

    def _profile_kv_budget(self) -> int:
        utilization = self.config.cache.memory_utilization
        if utilization is None:
            utilization = DEFAULT_GPU_MEMORY_UTILIZATION
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.model_runner.profile_run()
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            # Memory outside torch's allocator (CUDA context, NCCL buffers, other processes).
            non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)  # weights + activations
            # CUDA graphs are captured after the cache is made: their pool's share
            graphs = self.model_runner.cuda_graphs_memory_reserve()
            self.profile = {"total": total, "peak": peak, "non_torch": non_torch,
                            "cuda_graphs": graphs}
            return int(total * utilization) - peak - non_torch - graphs
        used_after_load = memory.process_rss()
        exact = memory.reset_peak_rss()
        before = memory.process_rss() if exact else memory.peak_rss()
        scratch_kv_bytes = self.model_runner.profile_run()
        activation_peak = max(0, memory.peak_rss() - before - scratch_kv_bytes)
        self.profile = {"total": self.cpu_total_memory, "used_after_load": used_after_load,
                        "activation_peak": activation_peak}
        return int(self.cpu_total_memory * utilization) - used_after_load - activation_peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks``; on the CPU its pages are populated by a background
        thread (``memory.populate_in_background``) while start-up goes on."""
        self.num_blocks = num_blocks
        kv_transfer = self.config.kv_transfer
        if (kv_transfer is not None and kv_transfer.is_producer
                and kv_transfer.kv_transport == "shm"):
            # A decode instance on this host copies held blocks straight out of it.
            self.model_runner.kv_cache_allocator = self._allocate_shared_kv_cache
        self.model_runner.initialize_kv_cache(num_blocks)
        if self.kv_connector is not None:  # again after a wake-up
            self.kv_connector.set_storage(self.model_runner.kv_cache_storage,
                                          getattr(self.kv_segment, "name", None))
        self.populate_thread = None
        if self.device.type == "cpu":
            storage = self.model_runner.kv_cache_storage
            self.populate_thread = memory.populate_in_background(
                [(storage.data_ptr(), storage.numel() * storage.element_size())])

    def warm_up(self) -> None:
        """One dummy decode step at batch sizes 1, 2, 4, ... before any request.

        Where oneDNN runs the linears (CPUs without AVX512-BF16), it builds a matmul
        kernel the first time it meets a shape, so the first step at each decode batch
        size ran about 1.5 ms (CPU) slower than the next (benchmarks/warm_up.md); loom's
        own matmul builds nothing per shape. Powers of two only: a start-up of a few
        tenths of a second, not the seconds every size took, for a gain of ~0.1 s over
        a process's life. Prefill chunks are not warmed: any token count up to
        max_num_batched_tokens may come, and there it is lost in the step. Batch sizes
        go up to max_num_seqs, at most WARM_UP_MAX_BATCH, and stop once
        WARM_UP_BUDGET_S has passed on any rank (every rank runs the same steps, so
        collectives stay in step). On CUDA it runs where decode steps become CUDA graphs
        (cuda_graphs.py): it captures the shortest contexts' graphs before any request.
        Off with ``enable_warm_up=False``.
        """
        if not self.config.model.enable_warm_up or (
                self.device.type != "cpu" and self.model_runner.cuda_graphs is None):
            return
        block_ids = self._warm_up_block_ids()
        if len(block_ids) > self.num_blocks:
            return  # a cache too small to lend the dummy requests their blocks
        started = time.monotonic()
        max_batch = min(self.config.scheduler.max_num_seqs,
                        self.config.scheduler.max_num_batched_tokens, WARM_UP_MAX_BATCH)
        if self.rank == 0:
            progress("warming up ...")
        # 0: the one-token prefill the others read; then 1, 2, 4, ..., max_batch
        batches = [0] + [2**i for i in range(max_batch.bit_length()) if 2**i < max_batch]
        finished: list[str] = []
        num_groups = len(self.model_runner.kv_cache_groups.windows)
        for batch in batches + [max_batch]:
            step = dummy_step(batch, block_ids, finished, num_groups)
            self.model_runner.execute_model(step)
            finished = list(step.num_scheduled_tokens)
            within_budget = time.monotonic() - started < WARM_UP_BUDGET_S
            # every rank whose MoE layers exchange tokens with this one stops with it
            if not (across_replicas() or self.tp_group).all_reduce_min(int(within_budget)):
                break
        self.model_runner.execute_model(dummy_step(None, block_ids, finished, num_groups))
        assert not self.model_runner.requests, "warm-up left requests in the model runner"
        logger.info("rank %d: warmed up decode batch sizes up to %d of %d in %.2fs", self.rank,
                    batch, max_batch, time.monotonic() - started)

    def _warm_up_block_ids(self) -> list[int]:
        """The real cache's first blocks: enough for two tokens and a draft model's
        lookahead. No request holds them yet, and whichever gets them writes each
        slot before attention reads it."""
        spec = self.config.speculative
        num_tokens = DUMMY_PROMPT_LEN + (spec.num_lookahead_tokens if spec else 0)
        return list(range(-(-num_tokens // self.config.cache.block_size)))

    def _allocate_shared_kv_cache(self, shape: tuple[int, ...], dtype: torch.dtype):
        from loom.worker.kv_transport import SharedKVSegment

        if self.kv_segment is not None:
            self.kv_segment.close()
        self.kv_segment = SharedKVSegment.create(shape, dtype, self.rank)
        return self.kv_segment.tensor

    def eplb_placement(self) -> dict[str, Any]:
        """EPLB: the MoE layers placed anew so far, and each layer's expert per slot."""
        runner = self.model_runner
        return {"rearranged": runner.eplb_rearrangements,
                "placement": [layer.physical_to_logical.tolist() for layer in runner.moe_layers]}

    def moe_expert_formats(self) -> list[list[list[str | None]]]:
        """Each MoE layer's local experts as held here: [w13 format, w2 format] per
        expert (wint8, Q4_0, ...; None for full precision), one list per layer."""
        return [[[e.w13.weight_format, e.w2.weight_format] for e in layer.experts]
                if layer.experts is not None
                else [[None, None]] * (layer.expert_end - layer.expert_start)
                for layer in self.model_runner.moe_layers]

    def collective_bytes(self) -> dict[str, int]:
        """Bytes this rank has handed to all-reduces and all-to-alls since start."""
        import dataclasses

        from loom.distributed.parallel_state import collective_bytes

        return dataclasses.asdict(collective_bytes)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        tier_ops = scheduler_output.kv_tier_ops
        refused = self._run_kv_tier(tier_ops) if tier_ops is not None else None
        metadata = scheduler_output.kv_connector_metadata
        if metadata is None or self.kv_connector is None:
            output = self.model_runner.execute_model(scheduler_output)
        else:
            self.kv_connector.before_step(metadata)
            output = self.model_runner.execute_model(scheduler_output)
            self.kv_connector.after_step(metadata)
        if refused:
            output.kv_tier_failed = refused
        return output

    # ------------------------------------------------- the KV offload tier

    def init_kv_tier(self, num_slots: int) -> None:
        """Open this rank's part of the KV offload tier (loom/worker/kv_tier_io.py):
        ``num_slots`` blocks in a file under ``--kv-offload-path``, or on CUDA without
        that flag in pinned host memory."""
        from loom.worker.kv_tier_io import KVTierWorker

        self.shutdown_kv_tier()
        cache = self.config.cache
        self.kv_tier = KVTierWorker(cache.kv_offload_dir_on(self.config.device), num_slots,
                                    self.model_runner, self.tp_group, self.config.model.model)

    def _run_kv_tier(self, ops) -> list[int]:
        """A step's copies to and from the tier, before its forward; the loads refused."""
        if self.kv_tier is None:
            raise RuntimeError("a step carries KV offload tier copies but this rank has no "
                               "tier (init_kv_tier was not called)")
        return self.kv_tier.run(ops)

    def shutdown_kv_tier(self) -> None:
        if self.kv_tier is not None:
            self.kv_tier.close()
            self.kv_tier = None

    # ------------------------------------------------- KV transfer (collective_rpc)

    def init_kv_connector(self, notify_address: str) -> str:
        """Start this rank's half of the KV connector (loom/worker/kv_connector.py),
        reporting to the engine core at ``notify_address``; returns where it listens
        (prefill side) or ""."""
        from loom.worker.kv_connector import KVConnectorWorker

        self.kv_connector = KVConnectorWorker(
            self.config.kv_transfer, self.tp_group.rank, self.tp_group.world_size,
            self.model_runner.kv_cache_storage, notify_address,
            getattr(self.kv_segment, "name", None), self.config.parallel.data_parallel_rank)
        return self.kv_connector.address

    def shutdown_kv_connector(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        if self.kv_segment is not None:
            self.kv_segment.close()
            self.kv_segment = None

    # ------------------------------------------------- weights that change (collective_rpc)
    # Called between steps on every rank, by the engine's collective_rpc; see
    # weight_updates.py for the states each moves the rank through.

    def update_weights(self, path: str | None = None, lora_name: str | None = None) -> dict:
        """Load every weight from a checkpoint directory, a .gguf file or an ipc manifest
        (None: the last checkpoint loaded); with ``lora_name``, that LoRA adapter's
        weights from its PEFT directory ``path`` instead, the base untouched."""
        if lora_name is not None:
            return self.weights.update_lora(lora_name, path)
        return self.weights.update_from_path(path)

    def update_weights_from_tensors(self, named_tensors) -> dict:
        """(checkpoint name, tensor) pairs from a caller in this process."""
        return self.weights.update_from_tensors(named_tensors)

    def clear_weights(self) -> None:
        self.weights.clear()

    def sleep(self, level: int = 1) -> dict:
        return self.weights.sleep(level)

    def wake_up(self) -> dict:
        return self.weights.wake_up()

    def weights_status(self) -> dict:
        """The rank's WeightsStatus now and every state it has entered."""
        return {"status": int(self.weights.status), "history": list(self.weights.history)}

    def cuda_graph_stats(self) -> dict:
        """CUDA graphs on this rank (worker/cuda_graphs.py): the (batch, context, tokens a
        request) buckets captured, the mixed steps' token buckets captured (the Triton
        backend's), the steps replayed, why graphs are off (None while on or never
        made)."""
        graphs = self.model_runner.cuda_graphs
        if graphs is None:
            return {"captured": [], "mixed_captured": [], "replays": 0, "disabled": None,
                    "made": False}
        return {"captured": sorted(map(list, graphs.graphs)),
                "mixed_captured": sorted(graphs.mixed_graphs), "replays": graphs.replays,
                "disabled": graphs.disabled, "made": True}

    def add_lora(self, name: str, path: str) -> dict:
        """Serve LoRA adapter ``name`` from ``path`` on every rank (loom/lora.py); one
        served already takes the new files (weight_updates.py: ``update_lora``)."""
        return self.weights.update_lora(name, path)

    def remove_lora(self, name: str) -> bool:
        return self.model_runner.lora is not None and self.model_runner.lora.remove(name)

    def lora_stats(self) -> dict:
        """This rank's adapters: in slots, held in host memory, registered (LoRAManager)."""
        if self.model_runner.lora is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora")
        return self.model_runner.lora.stats()

    def memory_usage(self) -> dict:
        """This rank's resident bytes (CPU: the process's RSS), and the bytes of its KV
        cache and of its parameters."""
        storage = self.model_runner.kv_cache_storage
        kv_bytes = 0 if storage is None else storage.numel() * storage.element_size()
        weight_bytes = sum(p.numel() * p.element_size()
                           for p in self.model_runner.model.parameters())
        return {"rss": memory.process_rss(), "kv_cache_bytes": kv_bytes,
                "weight_bytes": weight_bytes}


# Past 64 a cold first step costs its 1-2 ms in a step of 60 ms or more.
WARM_UP_MAX_BATCH = 64
WARM_UP_BUDGET_S = 1.0  # a slow machine or a large model warms up fewer batch sizes
# No --memory-utilization on CUDA: the share of the device the KV cache may take.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.5
DUMMY_PROMPT_LEN = 2
_DUMMY_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def dummy_step(batch: int | None, block_ids: list[int], finished: list[str],
               num_kv_cache_groups: int = 1) -> SchedulerOutput:
    """A warm-up step that also makes the runner forget the ``finished`` requests.

    Batch 0: one request prefills one token into slot 0. Batch b: b new requests of
    two tokens, the first counted as computed (as a prefix-cache hit would be), so
    each computes one token over a context of two: a pure decode step of b tokens.
    All share ``block_ids`` (slot 0 read, slot 1 overwritten), in every KV cache group.
    None: nothing runs.
    """
    if batch is None:
        req_ids, prompt = [], []
    elif batch == 0:
        req_ids, prompt = ["warm-up-prefill"], [0]
    else:
        req_ids, prompt = [f"warm-up-{batch}-{i}" for i in range(batch)], [0] * DUMMY_PROMPT_LEN
    num_computed = len(prompt) - 1 if batch else 0
    new_reqs = [NewRequestData(req_id=req_id, prompt_token_ids=prompt, output_token_ids=[],
                               sampling_params=_DUMMY_PARAMS, eos_token_ids=[],
                               block_ids=block_ids, num_computed_tokens=num_computed,
                               group_block_ids=[block_ids] * (num_kv_cache_groups - 1))
                for req_id in req_ids]
    num_scheduled = {req_id: len(prompt) - num_computed for req_id in req_ids}
    return SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=[],
                           num_scheduled_tokens=num_scheduled,
                           total_num_scheduled_tokens=sum(num_scheduled.values()),
                           finished_req_ids=finished)
