"""Expert parallel across data-parallel replicas and EPLB: the layouts refused at start-up
(one line, exit 2), and the engine cores' lock-step (core/dp_lockstep.py) on its own,
torch-free.
The served layout itself: tests/entrypoints/test_dp_expert_parallel.py."""

from __future__ import annotations

import threading

import pytest
from checkpoints import make_tiny_checkpoint
from test_cli_errors import assert_one_line_error, run_loom
from tokenizer_fixtures import make_tiny_tokenizer

from loom.engine_args import EngineArgs


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {}
    for family in ("qwen3_moe", "llama"):
        paths[family] = make_tiny_checkpoint(family, tmp_path_factory.mktemp(family))
        make_tiny_tokenizer(paths[family])
    return paths


def _config(path: str, **kwargs):
    return EngineArgs(model=path, max_model_len=64, **kwargs).create_engine_config()


def test_layouts_across_replicas_resolve_or_are_refused(models):
    moe, dense = models["qwen3_moe"], models["llama"]
    config = _config(moe, data_parallel_size=2, enable_expert_parallel=True)
    assert config.parallel.expert_parallel_size == 2 and config.parallel.experts_across_replicas
    from loom.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="the offline engine runs one replica"):
        LLMEngine(config)  # (before anything starts)
    config = _config(moe, data_parallel_size=2, tensor_parallel_size=2,
                     enable_expert_parallel=True)
    assert config.parallel.expert_parallel_size == 4
    # one replica: the tensor-parallel layout, as before
    config = _config(moe, tensor_parallel_size=2, enable_expert_parallel=True)
    assert config.parallel.expert_parallel_size == 2
    assert not config.parallel.experts_across_replicas
    with pytest.raises(ValueError, match="--expert-parallel-size 3 does not divide the "
                                         "model's 8 experts"):
        _config(moe, data_parallel_size=3, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="needs a MoE model, and LlamaForCausalLM has no experts"):
        _config(dense, data_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="must be 1, the tensor parallel size 1, or tensor x "
                                         "data parallel size 2"):
        _config(moe, data_parallel_size=2, expert_parallel_size=4)
    # on several hosts (test_dp_expert_parallel_hosts.py), with replica 0 on the head
    config = _config(moe, data_parallel_size=2, data_parallel_size_local=1,
                     enable_expert_parallel=True)
    assert config.parallel.experts_across_replicas
    with pytest.raises(ValueError, match="needs the head to run replica 0"):
        _config(moe, data_parallel_size=2, data_parallel_size_local=0,
                enable_expert_parallel=True)
    # EPLB: over expert-parallel ranks, full-precision experts, slots that divide
    config = _config(moe, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                     num_redundant_experts=2, eplb_window_size=100)
    assert (config.parallel.enable_eplb, config.parallel.num_redundant_experts,
            config.parallel.eplb_window_size) == (True, 2, 100)
    with pytest.raises(ValueError, match="only --enable-eplb does"):
        _config(moe, data_parallel_size=2, enable_expert_parallel=True, num_redundant_experts=2)
    with pytest.raises(ValueError, match="add --enable-expert-parallel"):
        _config(moe, data_parallel_size=2, enable_eplb=True)
    with pytest.raises(ValueError, match="8 \\+ 1 redundant experts"):
        _config(moe, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                num_redundant_experts=1)
    # quantized experts across replicas, EPLB moving them too
    # (test_dp_expert_parallel_quantized.py)
    config = _config(moe, data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                     num_redundant_experts=2, quantization="wint8")
    assert config.parallel.experts_across_replicas and config.parallel.enable_eplb


def test_serve_refuses_a_dense_model_and_slots_that_do_not_divide_in_one_line(models):
    run = run_loom("serve", models["llama"], "-dp", "2", "--enable-expert-parallel")
    assert_one_line_error(run, "has no experts", "--enable-expert-parallel")
    run = run_loom("serve", models["qwen3_moe"], "-dp", "2", "--enable-expert-parallel",
                   "--enable-eplb", "--num-redundant-experts", "1")
    assert_one_line_error(run, "--expert-parallel-size 2 does not divide", "1 redundant")


def _lockstep_pair(tmp_path, monkeypatch, bound_s: float = 30.0):
    import tempfile

    from loom.config import EngineConfig, ModelConfig, ParallelConfig
    from loom.core.dp_lockstep import DPLockstep

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cores = []
    for rank in range(2):
        parallel = ParallelConfig(data_parallel_size=2, data_parallel_rank=rank,
                                  expert_parallel_size=2, data_parallel_master_port=1234)
        cores.append(DPLockstep(EngineConfig(model=ModelConfig(model="m"), parallel=parallel),
                                bound_s))
    return cores


def test_lockstep_rounds_step_all_replicas_if_any_has_work(tmp_path, monkeypatch):
    cores = _lockstep_pair(tmp_path, monkeypatch)
    try:
        def both(flags: tuple[bool, bool]) -> list[bool]:
            decisions = [None, None]

            def run(rank: int) -> None:
                decisions[rank] = cores[rank].agree(flags[rank], lambda: None)

            threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(10)
            return decisions

        assert both((False, False)) == [False, False]  # nobody has work: all idle
        assert both((True, False)) == [True, True]  # the idle one takes a dummy step
        assert both((False, True)) == [True, True]
        # A core idle after a round is woken by a peer starting the next one.
        assert not cores[1].has_news
        woke = threading.Event()
        thread = threading.Thread(target=lambda: (cores[0].agree(True, lambda: None),
                                                  woke.set()))
        thread.start()
        assert cores[1].inbox.poll(10_000)  # what the idle core's poller waits on
        assert cores[1].has_news
        assert cores[1].agree(False, lambda: None) is True
        assert woke.wait(10)
        assert cores[0].round == cores[1].round == 4
    finally:
        for core in cores:
            core.close()


def test_lockstep_peer_that_never_answers_is_an_engine_death(tmp_path, monkeypatch):
    from loom.errors import EngineDeadError

    cores = _lockstep_pair(tmp_path, monkeypatch, bound_s=1.0)
    waits = []
    try:
        with pytest.raises(EngineDeadError, match=r"replicas \[1\] sent no step flag"):
            cores[0].agree(True, lambda: waits.append(1))
        assert waits  # the core checked its workers and parent meanwhile
    finally:
        for core in cores:
            core.close()
