"""The head's side of replicas on other hosts, as units: the rendezvous's answers to
headless hosts (the real processes are in tests/entrypoints/test_data_parallel.py) and
the merged answer of a control call under data parallel."""

from __future__ import annotations

import pytest

from loom.async_llm import ControlError
from loom.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from loom.core.wire import DPHello, DPRefusal, DPWelcome
from loom.dp_async_llm import merge_control_results
from loom.handshake import handshake_settings
from loom.ipc.remote_engine_core import HeadRendezvous


def _config(**parallel) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="/models/tiny-llama", vocab_size=256),
                        cache=CacheConfig(), parallel=ParallelConfig(**parallel))


def test_rendezvous_welcomes_its_remote_ranks_once_and_refuses_by_name():
    head = _config(data_parallel_size=4, data_parallel_size_local=1)
    rendezvous = HeadRendezvous(head, {rank: (f"tcp://h:{rank}0", f"tcp://h:{rank}1")
                                       for rank in (1, 2, 3)})
    # the same settings from another host (its own path to the model)
    other = handshake_settings(_config(data_parallel_size=4, data_parallel_size_local=2,
                                       data_parallel_start_rank=1))
    welcome = rendezvous.answer(DPHello("b", 1, 2, other))
    assert isinstance(welcome, DPWelcome)
    assert welcome.addresses == [(1, "tcp://h:10", "tcp://h:11"), (2, "tcp://h:20", "tcp://h:21")]

    taken = rendezvous.answer(DPHello("c", 2, 2, other))
    assert isinstance(taken, DPRefusal) and "rank(s) 2 already run on host b" in taken.message
    own = rendezvous.answer(DPHello("c", 0, 1, other))
    assert isinstance(own, DPRefusal)
    assert "runs rank(s) 0 itself and waits for 1..3" in own.message
    past = rendezvous.answer(DPHello("c", 3, 2, other))
    assert isinstance(past, DPRefusal) and "rank(s) 4 are not waited for" in past.message
    assert isinstance(rendezvous.answer(DPHello("c", 3, 0, other)), DPRefusal)

    differs = handshake_settings(EngineConfig(
        model=ModelConfig(model="/elsewhere/tiny-llama", vocab_size=256, dtype="bfloat16"),
        cache=CacheConfig(block_size=32),
        parallel=ParallelConfig(data_parallel_size=4, tensor_parallel_size=2)))
    refusal = rendezvous.answer(DPHello("c", 3, 1, differs))
    assert isinstance(refusal, DPRefusal)
    for fragment in ("--dtype is 'bfloat16' there, 'auto' on the head",
                     "--block-size is 32 there, 16 on the head",
                     "--tensor-parallel-size is 2 there, 1 on the head"):
        assert fragment in refusal.message, refusal.message
    assert "MODEL" not in refusal.message  # the same name at another path is the same model
    assert isinstance(rendezvous.answer(DPHello("c", 3, 1, other)), DPWelcome)


def test_control_answers_hold_for_every_replica():
    status = [{"paused": False, "is_sleeping": True, "sleep_level": 1, "num_held": 2},
              {"paused": False, "is_sleeping": False, "sleep_level": 0, "num_held": 0}]
    merged = merge_control_results("status", status)
    assert merged["is_sleeping"] is False and merged["num_held"] == 2
    assert merged["replicas"] == status
    assert merge_control_results("reset_prefix_cache", [True, False]) is False
    slept = merge_control_results("sleep", [{"level": 1, "kv_cache_bytes_freed": 5},
                                            {"level": 1, "kv_cache_bytes_freed": 7}])
    assert slept["kv_cache_bytes_freed"] == 12 and len(slept["replicas"]) == 2


def test_control_failing_on_some_replicas_names_them_and_the_state_left():
    with pytest.raises(ControlError) as raised:
        merge_control_results("update_weights", [
            {"seconds": 1.0}, ControlError("no weights at '/x'", "FileNotFoundError")])
    assert raised.value.exc_type == "PartialFailure"
    message = str(raised.value)
    assert "failed on 1 of 2 data-parallel replicas (replica 1: no weights at '/x')" in message
    assert "succeeded on replica 0" in message and "new weights" in message
    # every replica refused alike: the refusal's own type (a 400 for the caller's fault)
    with pytest.raises(ControlError) as raised:
        merge_control_results("sleep", [ControlError("busy", "RuntimeError")] * 2)
    assert raised.value.exc_type == "RuntimeError"


def test_a_draft_compares_by_its_name_not_its_path_or_hf_config():
    """Each host has its own path to the draft and its own transformers: the speculative
    flag compares as set (method, tokens, draft's name), not as read."""
    from types import SimpleNamespace

    from loom.config import SpeculativeConfig
    from loom.handshake import speculative_settings

    def settings(path, hf_config):
        spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model=path,
                                 hf_config=hf_config)
        return speculative_settings(SimpleNamespace(speculative=spec))

    here = settings("/models/draft-135m/", {"_name_or_path": "/models/draft-135m"})
    assert here == settings("/mnt/other/draft-135m", {"_name_or_path": "/mnt/other/draft-135m"})
    assert here["model"] == "draft-135m" and here["num_speculative_tokens"] == 2
    assert here != settings("/models/draft-360m", None)
    assert speculative_settings(SimpleNamespace(speculative=None)) is None
