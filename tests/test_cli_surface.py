"""The vLLM-compatible surface: flag parsing, LLM(**kwargs), get_tokenizer, token-id-only
use, the checkpoint's generation config as request defaults (offline and served), and
the periodic stats line of ``loom serve``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time

import pytest
from checkpoints import make_tiny_checkpoint, make_tiny_config
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.arg_types import human_readable_int
from loom.cli import build_parser
from loom.checkpoint_defaults import load_sampling_defaults, resolve_dtype
from loom.core.wire import EngineCoreOutput, SchedulerStats
from loom.llm import llm_kwargs_to_engine_args
from loom.metrics import ServerMetrics
from loom.stats_logger import LoggingStatLogger

GENERATION_CONFIG = {"eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.9, "top_k": 20,
                     "repetition_penalty": 1.1, "max_new_tokens": 5, "do_sample": True}
SMALL = {"max_model_len": 128, "kv_cache_memory_bytes": 2**22}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))
    make_tiny_tokenizer(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    return path


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    llm = LLM(tiny_model, **SMALL)
    yield llm
    llm.shutdown()


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("text,value", [("4096", 4096), ("32k", 32000), ("32K", 32768),
                                        ("25.6k", 25600), ("1m", 10**6), ("2M", 2 * 2**20)])
def test_human_readable_int_reads_as_vllm(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "0", "-3", "12x", "k"])
def test_human_readable_int_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_serve_takes_model_as_flag_or_positional():
    parser = build_parser()
    assert parser.parse_args(["serve", "--model", "m"]).model_flag == "m"
    assert parser.parse_args(["serve", "m"]).model == "m"
    worker = parser.parse_args(["worker", "--model", "m", "--max-model-len", "32k"])
    assert worker.model_flag == "m" and worker.max_model_len == 32000
    serve = parser.parse_args(["serve", "--enable-log-requests", "--disable-log-stats",
                               "--no-enable-chunked-prefill", "--trust-remote-code",
                               "--enforce-eager", "--dtype", "half",
                               "--override-generation-config", '{"temperature": 0}'])
    assert serve.enable_log_requests and serve.disable_log_stats
    assert serve.enable_chunked_prefill is False and serve.dtype == "half"
    assert serve.override_generation_config == {"temperature": 0}


def test_dtype_aliases_and_the_cpu_float16_warning(caplog):
    config = make_tiny_config("llama")
    assert resolve_dtype("float", config, "m", "cpu") == "float32"
    with caplog.at_level(logging.WARNING, logger="loom.config"):
        assert resolve_dtype("half", config, "m", "cpu") == "bfloat16"
    assert any("float16 runs as bfloat16 on the CPU" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loom.config"):
        assert resolve_dtype("bfloat16", config, "m", "cpu") == "bfloat16"
    assert not caplog.records
    with pytest.raises(ValueError, match="half"):
        resolve_dtype("double", config, "m", "cpu")


# ---------------------------------------------------------------- LLM(**kwargs)


def test_unknown_llm_argument_is_a_type_error_with_suggestions():
    with pytest.raises(TypeError, match=r"LLM\(\) got an unexpected keyword argument "
                                        r"'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM("/nonexistent", max_num_seq=4)  # refused before the model is looked for
    with pytest.raises(TypeError, match="'gpu_memory_utilisation'.*'gpu_memory_utilization'"):
        llm_kwargs_to_engine_args({"gpu_memory_utilisation": 0.5})


def test_vllm_argument_names_map_onto_loom():
    kwargs = llm_kwargs_to_engine_args({"gpu_memory_utilization": 0.3, "trust_remote_code": True,
                            "enforce_eager": True, "disable_log_stats": True, "revision": None,
                            "tokenizer_mode": "auto", "swap_space": 0, "seed": 1})
    assert kwargs == {"memory_utilization": 0.3, "trust_remote_code": True,
                      "enforce_eager": True, "seed": 1}
    with pytest.raises(ValueError, match=r"LLM\(revision='main'\) is not supported"):
        llm_kwargs_to_engine_args({"revision": "main"})


def test_get_tokenizer_is_a_hugging_face_tokenizer(llm):
    from transformers import PreTrainedTokenizerBase

    tokenizer = llm.get_tokenizer()
    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    ids = tokenizer.encode("hello world")
    assert tokenizer(["hello world"])["input_ids"] == [ids]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.convert_ids_to_tokens([2]) == ["<|im_end|>"]
    assert tokenizer.eos_token_id == 2 and tokenizer.vocab_size == 256
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_skip_tokenizer_init_works_on_token_ids_alone(tiny_model, tmp_path):
    weights_only = tmp_path / "weights-only"  # no tokenizer files at all
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(os.path.join(tiny_model, name), weights_only / name)
    llm = LLM(str(weights_only), skip_tokenizer_init=True, **SMALL)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=6)
        (output,) = llm.generate([[150, 188, 150]], greedy, use_tqdm=False)
        assert output.prompt_token_ids == [150, 188, 150]
        assert len(output.outputs[0].token_ids) >= 1 and output.outputs[0].text == ""
        with_text = LLM(tiny_model, **SMALL)
        try:
            (reference,) = with_text.generate({"prompt_token_ids": [150, 188, 150]}, greedy,
                                              use_tqdm=False)
        finally:
            with_text.shutdown()
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids
        with pytest.raises(ValueError, match="give prompts as token ids"):
            llm.generate("text", use_tqdm=False)
        with pytest.raises(ValueError, match="stop strings need the tokenizer"):
            llm.generate([[5]], SamplingParams(stop=["x"]), use_tqdm=False)
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            llm.get_tokenizer()
    finally:
        llm.shutdown()


# ---------------------------------------------------------------- generation config


def test_generation_config_sampling_defaults(tiny_model, tmp_path):
    expected = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                "max_tokens": 5}
    assert load_sampling_defaults(tiny_model) == expected
    assert load_sampling_defaults(tiny_model, "vllm") == {}
    assert load_sampling_defaults(tiny_model, "vllm", '{"temperature": 0}') == {"temperature": 0}
    assert load_sampling_defaults(tiny_model, "auto", {"max_new_tokens": 9})["max_tokens"] == 9
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"min_p": 0.05}')
    assert load_sampling_defaults(tiny_model, str(other)) == {"min_p": 0.05}
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        load_sampling_defaults(tiny_model, "auto", {"top_p": 7})
    with pytest.raises(ValueError, match="--generation-config /nowhere does not exist"):
        load_sampling_defaults(tiny_model, "/nowhere")


def test_gguf_has_no_generation_config(tmp_path):
    assert load_sampling_defaults(str(tmp_path / "model.gguf")) == {}


def test_llm_applies_the_generation_config_when_given_no_params(llm, tiny_model):
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens,
            defaults.repetition_penalty) == (0.6, 0.9, 20, 5, 1.1)
    (output,) = llm.generate("the quick brown fox", use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= 5
    plain = LLM(tiny_model, generation_config="vllm", **SMALL)
    try:
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        plain.shutdown()


def test_server_applies_the_generation_config_and_logs_stats(tiny_model):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "entrypoints"))
    from loom_server import TINY_SERVER_ARGS, LoomServer

    server = LoomServer(tiny_model, *TINY_SERVER_ARGS, "--enable-log-requests",
                        env={"LOOM_LOG_STATS_INTERVAL": "1"})  # not the 10 s default
    try:
        client = server.openai()
        model = os.path.basename(tiny_model)
        messages = [{"role": "user", "content": "tell me a story"}]
        # Chat's max_tokens defaults to the checkpoint's max_new_tokens (completions keep
        # OpenAI's 16, as in vLLM).
        chat = client.chat.completions.create(model=model, messages=messages,
                                              extra_body={"ignore_eos": True})
        assert chat.usage.completion_tokens == 5
        explicit = client.chat.completions.create(model=model, messages=messages, max_tokens=7,
                                                  extra_body={"ignore_eos": True})
        assert explicit.usage.completion_tokens == 7
        deadline = time.monotonic() + 30
        while "Avg generation throughput" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.5)
        output = server.output()
    finally:
        server.close()
    assert "Avg prompt throughput" in output and "KV cache usage" in output, output
    assert "request chatcmpl-" in output and "temperature=0.6" in output, output


# ---------------------------------------------------------------- stats line


def test_stats_line_reports_the_interval_then_goes_quiet():
    metrics = ServerMetrics("m")
    stats = LoggingStatLogger(metrics, "m")
    start = stats._last_time
    assert stats.log(start + 10) is None  # idle from the start: nothing to say
    metrics.record_sequence_added("r", num_prompt_tokens=100, arrival_time=0.0)
    metrics.record_scheduler_stats(SchedulerStats(num_running=1, num_waiting=2,
                                                  kv_cache_usage=0.25, prefix_cache_queries=100,
                                                  prefix_cache_hits=40, num_preemptions=0))
    metrics.record_core_outputs([EngineCoreOutput(req_id="r", new_token_ids=[1])], now=1.0)
    for step in range(2, 21):
        metrics.record_core_outputs([EngineCoreOutput(req_id="r", new_token_ids=[1])],
                                    now=float(step))
    line = stats.log(start + 20)
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 2.0 "
                    "tokens/s, Running: 1 reqs, Waiting: 2 reqs, KV cache usage: 25.0%, "
                    "Prefix cache hit rate: 40.0%")
    metrics.record_scheduler_stats(SchedulerStats(0, 0, 0.0, 100, 40, 0))
    assert "Running: 0 reqs" in stats.log(start + 30)  # the work has drained: one last line
    assert stats.log(start + 40) is None
