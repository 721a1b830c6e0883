"""Weights that change under a live offline engine: update_weights from a
checkpoint directory, from tensors and from a trainer process's shared memory (ipc);
a refused update; sleep and wake_up; collective_rpc.

Tiny random checkpoints A and B of one architecture: after an update to B, greedy
tokens equal those of a fresh engine on B, token for token; the prefix cache holds
nothing computed under A.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from checkpoints import make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer
from weight_variants import make_variant, variant_tensors

from loom import LLM, SamplingParams

SEED_B = 4242
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# A long one (four full blocks, cached) and two short ones.
PROMPTS = [list(range(3, 67)), [5, 6, 7], [200, 17, 9, 41, 77]]
ENGINE = dict(max_model_len=256, seed=0, enable_warm_up=False)
NORMAL, UPDATING, CLEARING, CLEARED = 0, 1, -1, -2
UPDATE_STATES = [NORMAL, CLEARING, CLEARED, UPDATING, NORMAL]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    a = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("weights-a"))
    make_tiny_tokenizer(a)
    b = make_variant(a, str(tmp_path_factory.mktemp("weights-b")), SEED_B)
    return a, b


def generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


_fresh: dict[tuple, list[list[int]]] = {}


def fresh_outputs(path: str, **kwargs) -> list[list[int]]:
    """Greedy tokens of a fresh engine on ``path`` (memoized per path and arguments)."""
    key = (path, tuple(sorted(kwargs.items())))
    if key not in _fresh:
        with LLM(path, **ENGINE, **kwargs) as llm:
            _fresh[key] = generate(llm)
    return _fresh[key]


def prefix_hits(llm: LLM) -> int:
    return llm.engine.engine_core.get_stats().prefix_cache_hits


def _quantization(name: str):
    from loom.config import QUANTIZATION_CHOICES

    return pytest.param(dict(dtype="bfloat16", quantization=name), id=f"bfloat16-{name}",
                        marks=pytest.mark.skipif(name not in QUANTIZATION_CHOICES,
                                                 reason=f"--quantization {name} not built"))


@pytest.mark.parametrize("kwargs", [pytest.param(dict(dtype="float32"), id="float32"),
                                    pytest.param(dict(dtype="bfloat16"), id="bfloat16-packed"),
                                    _quantization("wint8"), _quantization("wint4")])
def test_update_from_directory_equals_fresh_engine(checkpoints, kwargs):
    """Packed CPU weights, the recorded forwards and wint8's int8 copies are all made
    again from the new weights: the same tokens as a fresh engine on B (with the same
    dtype and quantization)."""
    a, b = checkpoints
    expected_a, expected_b = fresh_outputs(a, **kwargs), fresh_outputs(b, **kwargs)
    assert expected_a != expected_b
    with LLM(a, **ENGINE, **kwargs) as llm:
        assert generate(llm) == expected_a
        model = llm.engine.engine_core.executor.worker.model_runner.model
        replay = getattr(model, "kernel_replay", None)
        replayed_before = replay is not None and replay.stats.replayed > 0
        recorded_before = replay.stats.recorded if replay is not None else 0
        hits = prefix_hits(llm)
        started = time.perf_counter()
        result = llm.update_weights(b)
        print(f"update_weights(B) {kwargs}: {time.perf_counter() - started:.3f}s, "
              f"{result['num_parameters']} parameters")
        # The long prompt's blocks were cached under A: recomputed, not hit.
        assert generate(llm) == expected_b
        assert prefix_hits(llm) == hits, "a prefix computed under A was reused under B"
        assert generate(llm) == expected_b  # and cached again, under B
        assert prefix_hits(llm) > hits
        # The same execution path as before, on the new weights: forwards recorded again
        # where the CPU kernels run them (bf16); the modules for float32 and wint8.
        if replayed_before:
            assert replay.refusal is None and replay.stats.recorded > recorded_before
        else:
            assert replay is None or replay.stats.replayed == 0
        [status] = llm.collective_rpc("weights_status")
        assert status == {"status": NORMAL, "history": UPDATE_STATES}
        # Freed whole (a quantized layer's kernel layout too) and reloaded from B.
        llm.sleep(level=2)
        assert llm.collective_rpc("memory_usage")[0]["weight_bytes"] == 0
        llm.wake_up()
        assert generate(llm) == expected_b


@pytest.mark.parametrize("family", ["qwen3", "llama_tied_rope3", "gemma3", "qwen3_moe"])
def test_update_every_kind_of_family(family, tmp_path):
    """q/k norms, tied embeddings, Gemma's norms and sliding window, MoE experts: each
    family's own load_weights maps the new tensors; the tokens equal a fresh engine's."""
    a = make_tiny_checkpoint(family, tmp_path / "a")
    make_tiny_tokenizer(a)
    b = make_variant(a, str(tmp_path / "b"), SEED_B)
    expected_b = fresh_outputs(b, dtype="float32")
    with LLM(a, dtype="float32", **ENGINE) as llm:
        expected_a = generate(llm)
        llm.update_weights(b)
        assert generate(llm) == expected_b != expected_a


def _update_part_then_sleep(tmp_path, family: str, part, check_held) -> None:
    """An update of the tensors of B that ``part(name)`` selects keeps every other weight
    (the tokens of a fresh engine on A with that part from B), sleep(2) frees them all
    and wake_up reloads A; ``check_held(model)`` asserts how the weights are held first."""
    from safetensors.torch import load_file

    a = make_tiny_checkpoint(family, tmp_path / "a")
    make_tiny_tokenizer(a)
    a_tensors = load_file(os.path.join(a, "model.safetensors"))
    new = {name: tensor for name, tensor in variant_tensors(a, SEED_B).items() if part(name)}
    assert new
    c = make_variant(a, str(tmp_path / "c"), SEED_B,
                     edit={name: t for name, t in a_tensors.items() if name not in new})
    expected_a = fresh_outputs(a, dtype="bfloat16")
    expected_c = fresh_outputs(c, dtype="bfloat16")
    assert expected_a != expected_c, "the part changes nothing: the test tests nothing"
    with LLM(a, **ENGINE, dtype="bfloat16") as llm:
        check_held(llm.engine.engine_core.executor.worker.model_runner.model)
        llm.update_weights_from_tensors(new.items())
        assert generate(llm) == expected_c
        llm.sleep(level=2)
        assert llm.collective_rpc("memory_usage")[0]["weight_bytes"] == 0
        llm.wake_up()
        assert generate(llm) == expected_a


def test_moe_experts_held_as_panels_update_in_part_and_sleep(tmp_path):
    """bf16 MoE experts, held only as loom's packed panels: an update of one expert's
    tensors keeps every other expert, sleep(2) frees them all and wake_up reloads A."""
    from loom.kernels import native_ops
    from loom.model.layers.fused_moe import FusedMoE

    if native_ops() is None or not native_ops().bf16_gemm_available():
        pytest.skip("experts are held as panels only with loom's bf16 kernel (AVX512-BF16)")

    def panels_alone(model) -> None:
        moes = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert moes and all(m.w13_weight.dim() == 5 for m in moes)

    _update_part_then_sleep(tmp_path, "qwen3_moe", lambda name: ".mlp.experts.1." in name,
                            panels_alone)


def test_tied_table_held_as_panels_updates_and_sleeps(tmp_path):
    """A bf16 tied table is held once, as the LM head's panels, and the embedding
    gathers its rows from them: an update of the table alone changes both, sleep(2)
    frees it and wake_up reloads A."""
    from loom.model.loader.model_loader import weight_bytes_by_dtype

    def table_once(model) -> None:
        head = model.lm_head
        assert head.weight is model.model.embed_tokens.weight  # tied
        if head.panels is not None:  # loom's bf16 kernel here: the panels alone
            assert head.weight.dim() == 4 and "packed" not in weight_bytes_by_dtype(model)

    _update_part_then_sleep(tmp_path, "llama_tied_rope3",
                            lambda name: name == "model.embed_tokens.weight", table_once)


def test_update_from_tensors_equals_fresh_engine(checkpoints):
    a, b = checkpoints
    with LLM(a, dtype="float32", **ENGINE) as llm:
        llm.update_weights_from_tensors(variant_tensors(a, SEED_B).items())
        assert generate(llm) == fresh_outputs(b, dtype="float32")
        # A subset is an update too: only the final norm back to A's.
        from safetensors.torch import load_file

        a_norm = load_file(os.path.join(a, "model.safetensors"))["model.norm.weight"]
        llm.update_weights_from_tensors([("model.norm.weight", a_norm)])
        assert generate(llm) != fresh_outputs(b, dtype="float32")


def test_ipc_update_from_a_trainer_process(checkpoints):
    """A separate process publishes B through shared memory; the engine maps it."""
    a, b = checkpoints
    trainer = start_trainer(a, SEED_B)
    try:
        manifest = trainer.stdout.readline().strip()
        with LLM(a, dtype="float32", **ENGINE) as llm:
            started = time.perf_counter()
            llm.update_weights(manifest)
            print(f"ipc update: {time.perf_counter() - started:.3f}s")
            assert generate(llm) == fresh_outputs(b, dtype="float32")
    finally:
        stop_trainer(trainer)


def start_trainer(a: str, seed: int) -> subprocess.Popen:
    helper = os.path.join(os.path.dirname(os.path.dirname(__file__)), "weight_variants.py")
    return subprocess.Popen([sys.executable, helper, a, str(seed)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def stop_trainer(trainer: subprocess.Popen) -> None:
    trainer.stdin.write("done\n")
    trainer.stdin.flush()
    assert trainer.wait(30) == 0


def test_refused_updates_leave_the_old_weights_serving(checkpoints, tmp_path):
    a, b = checkpoints
    wrong_shape = make_variant(a, str(tmp_path / "wrong-shape"), 7, edit={
        "model.layers.1.mlp.down_proj.weight": torch.zeros(64, 100)})
    missing = make_variant(a, str(tmp_path / "missing"), 7, edit={
        "model.layers.0.self_attn.k_proj.weight": None})
    unknown = make_variant(a, str(tmp_path / "unknown"), 7, edit={
        "model.layers.9.mlp.up_proj.weight": torch.zeros(128, 64)})
    with LLM(a, dtype="float32", **ENGINE) as llm:
        expected_a = generate(llm)
        with pytest.raises(ValueError, match="does not fit|does not match"):
            llm.update_weights(wrong_shape)
        with pytest.raises(ValueError, match="lack 1 parameters.*qkv_proj"):
            llm.update_weights(missing)
        with pytest.raises(ValueError, match="no matching parameter"):
            llm.update_weights(unknown)
        with pytest.raises(FileNotFoundError, match="no weights at"):
            llm.update_weights(str(tmp_path / "nowhere"))
        with pytest.raises(ValueError, match="does not fit|does not match"):
            llm.update_weights_from_tensors([("model.layers.0.mlp.gate_proj.weight",
                                              torch.zeros(3, 3))])
        assert generate(llm) == expected_a
        [status] = llm.collective_rpc("weights_status")
        assert status["history"] == [NORMAL], "a refused update changed the weights' state"


def test_a_copy_that_fails_midway_frees_the_weights_never_mixes(checkpoints):
    """An update whose checks pass but whose copy breaks part way (here a tensor with no
    data behind it, after one that copied): no old/new mix is ever served. Every rank
    frees its weights and the engine sleeps (level 2): generate refuses, and a good
    update brings weights back, equal to a fresh engine's."""
    from loom.errors import WeightsLostError

    a, b = checkpoints
    b_tensors = variant_tensors(a, SEED_B)
    with LLM(a, dtype="float32", **ENGINE) as llm:
        broken = [("model.norm.weight", b_tensors["model.norm.weight"]),
                  ("model.layers.0.mlp.down_proj.weight",
                   torch.empty(b_tensors["model.layers.0.mlp.down_proj.weight"].shape,
                               device="meta"))]
        with pytest.raises(WeightsLostError, match="failed while copying.*freed on every rank"):
            llm.update_weights_from_tensors(broken)
        assert llm.is_sleeping()
        [status] = llm.collective_rpc("weights_status")
        assert status["history"][-2:] == [CLEARING, CLEARED]
        with pytest.raises(RuntimeError, match="asleep"):
            generate(llm)
        llm.update_weights(b)
        assert not llm.is_sleeping()
        assert generate(llm) == fresh_outputs(b, dtype="float32")


def test_sleep_and_wake_up(checkpoints):
    """Level 1 frees the KV cache (RSS drops by its size), level 2 the weights too;
    after wake_up the tokens are the same."""
    a, _ = checkpoints
    # 8,192 blocks of 8 KiB (2 layers x K, V x 16 tokens x 2 heads x 16 x 4 bytes): 64 MiB
    with LLM(a, dtype="float32", num_gpu_blocks_override=8192, **ENGINE) as llm:
        expected = generate(llm)
        llm.engine.engine_core.executor.worker.populate_thread.join()  # KV pages resident
        [before] = llm.collective_rpc("memory_usage")
        result = llm.sleep(level=1)
        [asleep] = llm.collective_rpc("memory_usage")
        print(f"sleep(1): RSS {before['rss'] / 2**20:.1f} -> {asleep['rss'] / 2**20:.1f} MiB "
              f"(KV cache {result['kv_cache_bytes_freed'] / 2**20:.1f} MiB)")
        assert result["kv_cache_bytes_freed"] == before["kv_cache_bytes"] == 64 * 2**20
        assert before["rss"] - asleep["rss"] >= 0.9 * result["kv_cache_bytes_freed"]
        assert llm.is_sleeping()
        with pytest.raises(RuntimeError, match="asleep"):
            generate(llm)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert generate(llm) == expected

        result = llm.sleep(level=2)
        [asleep] = llm.collective_rpc("memory_usage")
        print(f"sleep(2): RSS {before['rss'] / 2**20:.1f} -> {asleep['rss'] / 2**20:.1f} MiB, "
              f"weights {before['weight_bytes'] / 2**20:.2f} -> "
              f"{asleep['weight_bytes'] / 2**20:.2f} MiB")
        assert asleep["weight_bytes"] == 0 and asleep["kv_cache_bytes"] == 0
        assert before["rss"] - asleep["rss"] >= 0.9 * result["kv_cache_bytes_freed"]
        llm.wake_up()
        assert generate(llm) == expected
        [status] = llm.collective_rpc("weights_status")
        assert status["history"] == [NORMAL, CLEARING, CLEARED, UPDATING, NORMAL]


def test_tensor_parallel_updates(checkpoints):
    """TP=2, worker processes: from a directory, a refused one, from tensors (mapped
    from shared memory by both ranks), from a trainer process (ipc), sleep and wake;
    both ranks through the same states."""
    a, b = checkpoints
    expected_a = fresh_outputs(a, dtype="float32")
    expected_b = fresh_outputs(b, dtype="float32")
    with LLM(a, dtype="float32", tensor_parallel_size=2, **ENGINE) as llm:
        assert generate(llm) == expected_a
        llm.update_weights(b)
        assert generate(llm) == expected_b
        statuses = llm.collective_rpc("weights_status")
        assert [s["history"] for s in statuses] == [UPDATE_STATES] * 2
        with pytest.raises(ValueError, match="does not fit|does not match"):
            llm.update_weights_from_tensors([("model.layers.0.mlp.down_proj.weight",
                                              torch.zeros(64, 7))])
        assert generate(llm) == expected_b
        from safetensors.torch import load_file

        llm.update_weights_from_tensors(load_file(os.path.join(a, "model.safetensors")).items())
        assert generate(llm) == expected_a
        trainer = start_trainer(a, SEED_B)  # both ranks map a trainer process's segment
        try:
            llm.update_weights(trainer.stdout.readline().strip())
        finally:
            stop_trainer(trainer)
        assert generate(llm) == expected_b
        llm.update_weights(a)
        signal = llm.engine.engine_core.executor.signals.weights_status  # shared memory
        assert signal.tolist() == [NORMAL, NORMAL]
        llm.sleep(level=2)
        assert signal.tolist() == [CLEARED, CLEARED]
        llm.wake_up()  # reloads A, the last checkpoint loaded from disk
        assert signal.tolist() == [NORMAL, NORMAL]
        assert generate(llm) == expected_a
        statuses = llm.collective_rpc("weights_status")
        assert statuses[0]["history"] == statuses[1]["history"]
