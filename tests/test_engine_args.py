"""One declaration per argument: the flags of every engine command, the keyword arguments
of ``LLM(...)`` and the fields of the config all come from ``EngineArgs``'s fields."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from checkpoints import make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer

from loom.cli import build_parser
from loom.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                         StructuredOutputsConfig)
from loom.engine_args import API, ENGINE, SERVE, EngineArgs, llm_kwarg_names, llm_kwargs_to_fields

FIELDS = {spec.name: spec for spec in dataclasses.fields(EngineArgs)}
# Config fields no argument declares: read from the checkpoint (checkpoint_defaults.py),
# given to each data-parallel replica, or a fixed bound.
DERIVED = {"model.vocab_size", "model.sampling_defaults", "model.hf_config", "model.pooler",
           "parallel.data_parallel_rank", "parallel.worker_start_timeout_s",
           "parallel.data_parallel_master_port",
           "parallel.data_parallel_lockstep_addresses"}


def _engine_commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Every subcommand (bench's too) that carries the engine flags, by name."""
    found = {}

    def walk(prefix, parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{prefix} {name}".strip(), sub)
        groups = {group.title for group in parser._action_groups}
        if "engine" in groups:
            found[prefix] = parser

    walk("", parser)
    return found


def _group_dests(parser: argparse.ArgumentParser, title: str) -> dict[str, argparse.Action]:
    for group in parser._action_groups:
        if group.title == title:
            return {action.dest: action for action in group._group_actions}
    return {}


def _config_fields() -> set[str]:
    """``section.name`` for every field of a sub-config, the name of every other field."""
    sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                "parallel": ParallelConfig, "structured_outputs": StructuredOutputsConfig}
    fields = {f"{section}.{spec.name}" for section, cls in sections.items()
              for spec in dataclasses.fields(cls)}
    return fields | {spec.name for spec in dataclasses.fields(EngineConfig)
                     if spec.name not in sections}


def test_every_engine_command_has_exactly_the_declared_flags():
    commands = _engine_commands(build_parser())
    assert set(commands) == {"generate", "chat", "serve", "worker", "bench throughput",
                             "bench latency"}
    engine = {name for name, spec in FIELDS.items() if spec.metadata["scope"] == ENGINE}
    serve = {name for name, spec in FIELDS.items() if spec.metadata["scope"] == SERVE}
    for name, parser in commands.items():
        dests = _group_dests(parser, "engine")
        assert set(dests) == engine, name
        for dest, action in dests.items():
            assert action.default == FIELDS[dest].default, (name, dest)
            assert action.help == FIELDS[dest].metadata["help"], (name, dest)
        assert set(_group_dests(parser, "engine (loom serve)")) == (
            serve if name == "serve" else set()), name


def test_llm_takes_every_field_but_the_model_and_nothing_else():
    assert set(llm_kwarg_names()) == set(FIELDS) - {"model"}
    every = {name: spec.default for name, spec in FIELDS.items() if name != "model"}
    assert llm_kwargs_to_fields(every) == every
    with pytest.raises(TypeError, match="'max_num_seq'; did you mean 'max_num_seqs'"):
        llm_kwargs_to_fields({"max_num_seq": 4})


def test_each_config_field_comes_from_one_argument_or_is_derived():
    targets = [target for spec in FIELDS.values() for target in spec.metadata["to"]]
    assert len(targets) == len(set(targets)), "a config field declared by two arguments"
    config_fields = _config_fields()
    assert set(targets) <= config_fields, set(targets) - config_fields
    assert config_fields - set(targets) == DERIVED
    for spec in FIELDS.values():
        assert spec.metadata["scope"] in (ENGINE, SERVE, API)


def test_flags_reach_their_config_fields(tmp_path):
    """Non-default values on the command line arrive in the config where ``to`` says."""
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    make_tiny_tokenizer(path)
    args = build_parser().parse_args([
        "serve", path, "--max-num-seqs", "7", "--block-size", "32", "--no-enable-prefix-caching",
        "--kv-cache-memory", "8MiB", "--kv-cache-dtype", "int8", "--max-model-len", "96",
        "--seed", "5",
        "--structured-outputs-disable-any-whitespace", "--watchdog-timeout", "9",
        "--served-model-name", "tiny", "-dp", "2", "--quantization-group-size", "64",
        "--no-enable-warm-up", "--dtype", "float"])
    args.model = path
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.scheduler.max_num_seqs == 7
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.cache.kv_cache_memory_bytes == 8 * 2**20
    assert config.cache.kv_cache_dtype == "int8"
    for flag, name in (("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")):
        fp8 = build_parser().parse_args(["serve", path, "--kv-cache-dtype", flag])
        fp8.model = path
        # fp8 is vLLM's name for fp8_e4m3
        assert EngineArgs.from_cli_args(fp8).create_engine_config().cache.kv_cache_dtype == name
    assert config.model.max_model_len == config.scheduler.max_model_len == 96
    assert config.model.seed == 5 and config.model.name == "tiny"
    assert config.structured_outputs.disable_any_whitespace
    assert config.parallel.watchdog_timeout_s == 9.0
    assert config.parallel.data_parallel_size == 2
    assert config.model.quantization_group_size == 64 and not config.model.enable_warm_up
    assert config.model.dtype == "float32"
    # What the checkpoint resolved: the step's budget, chunked prefill, the address.
    assert config.scheduler.max_num_batched_tokens == 2048
    assert config.scheduler.enable_chunked_prefill
    assert config.parallel.data_parallel_address == "127.0.0.1"


def test_max_logprobs_bounds_every_request(tmp_path, capsys):
    """--max-logprobs: a flag with a checked value, and the engine's bound on logprobs
    and prompt_logprobs (the server's 400: test_routes_in_process.py)."""
    from loom.config import ModelConfig
    from loom.input_processor import InputProcessor, InvalidInputError
    from loom.sampling_params import SamplingParams
    from loom.tokenizer import load_tokenizer

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--max-logprobs", "-1"])
    assert exit_info.value.code == 2
    assert "--max-logprobs: must be a non-negative integer, got -1" in capsys.readouterr().err
    tokenizer = load_tokenizer(make_tiny_tokenizer(str(tmp_path / "tokenizer")))
    processor = InputProcessor(ModelConfig(model="m", max_logprobs=2), tokenizer)
    processor.validate_params(SamplingParams(logprobs=2, prompt_logprobs=2))
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidInputError, match=f"{name} must be at most 2") as error:
            processor.validate_params(SamplingParams(**{name: 3}))
        assert error.value.param == name


def test_logprobs_mode_flag_and_its_refusal(tmp_path, capsys):
    """--logprobs-mode takes vLLM's four modes (tests/model/test_sampler.py checks their
    values); a processed mode with speculative decoding is refused in one line."""
    from checkpoints import make_tiny_checkpoint

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "--logprobs-mode", "logits"])
    assert exit_info.value.code == 2 and "--logprobs-mode" in capsys.readouterr().err
    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    make_tiny_tokenizer(path)
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="processed_logits is not supported with speculative"):
        EngineArgs(model=path, max_model_len=64, logprobs_mode="processed_logits",
                   speculative_config=ngram).create_engine_config()
    config = EngineArgs(model=path, max_model_len=64, logprobs_mode="raw_logits",
                        speculative_config=ngram).create_engine_config()
    assert config.model.logprobs_mode == "raw_logits"


def test_a_logits_processor_that_cannot_be_found_is_one_line(tmp_path, capsys):
    from checkpoints import make_tiny_checkpoint

    from loom.cli import main

    path = make_tiny_checkpoint("llama", tmp_path / "tiny")
    make_tiny_tokenizer(path)
    code = main(["generate", "--model", path, "--prompt", "hi", "--max-model-len", "64",
                 "--logits-processors", "nowhere_at_all:Ban"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no module named 'nowhere_at_all'" in err[0]
