"""LoRA adapters (loom/lora.py): greedy tokens with an adapter equal transformers + PEFT's
merged model (float32) for dense families and a mixture of experts' attention; a batch
mixing two adapters and the base equals each served alone; prefix caching does not
share blocks across adapters; the server serves adapters by name; each bad adapter is
refused naming it; tensor parallel over 2 ranks gives the same tokens, and a wint4 base
with an adapter its dequantized self with it merged. (The server:
tests/entrypoints/test_lora_serving.py.)"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from checkpoints import make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, LoRARequest, SamplingParams

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
ENGINE = dict(dtype="float32", max_model_len=128, enable_warm_up=False, enable_lora=True,
              max_loras=2, max_lora_rank=8)


def make_adapter(base: str, path: str, seed: int, rank: int, targets: list[str]):
    """A PEFT adapter of ``base`` with random A and B, saved at ``path``; returns the
    transformers model with it merged (the reference)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                  target_modules=targets,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.3)
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


def hf_greedy(model, prompt: list[int], steps: int = 8) -> list[int]:
    """transformers' greedy tokens, ``steps`` of them whatever they are (eos included)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen3_moe"])
def case(request, tmp_path_factory):
    """A base checkpoint, two adapters (ranks 8 and 4; the MoE's on its attention) and
    the reference greedy tokens of each and of the base."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(request.param)
    base = make_tiny_tokenizer(make_tiny_checkpoint(request.param, root / "base"))
    targets = ATTENTION if request.param == "qwen3_moe" else ALL
    adapters = {"a1": (str(root / "a1"), make_adapter(base, str(root / "a1"), 1, 8, targets)),
                "a2": (str(root / "a2"), make_adapter(base, str(root / "a2"), 2, 4, targets))}
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    want = {name: [hf_greedy(model, p) for p in PROMPTS] for name, (_, model) in adapters.items()}
    want[None] = [hf_greedy(plain, p) for p in PROMPTS]
    return base, {name: path for name, (path, _) in adapters.items()}, want, request.param


def generate(llm, loras) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                           lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_equal_peft_merged_and_mix_in_one_batch(case):
    base, paths, want, _ = case
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(paths.items())}
    with LLM(base, **ENGINE) as llm:
        for name in ("a1", "a2", None):
            assert generate(llm, requests.get(name)) == want[name], name
        mixed = generate(llm, [requests["a1"], None, requests["a2"]])
    assert mixed == [want["a1"][0], want[None][1], want["a2"][2]]


def test_tensor_parallel_2_equals_peft_merged(case):
    """Each rank holds its share of an adapter, cut as its base layer is: q/k/v and
    gate/up by output rows, o and down by input columns (summed in the all-reduce)."""
    base, paths, want, family = case
    if family == "qwen3_moe":
        pytest.skip("the dense families show the split")
    requests = [LoRARequest("a1", 1, paths["a1"]), None, LoRARequest("a2", 2, paths["a2"])]
    with LLM(base, tensor_parallel_size=2, **ENGINE) as llm:
        assert generate(llm, requests) == [want["a1"][0], want[None][1], want["a2"][2]]


def test_prefix_cache_is_not_shared_across_adapters(case):
    base, paths, _, _ = case
    prompt = {"prompt_token_ids": list(range(40, 80))}  # several whole blocks
    with LLM(base, **ENGINE) as llm:
        first = llm.generate(prompt, GREEDY, use_tqdm=False,
                             lora_request=LoRARequest("a1", 1, paths["a1"]))[0]
        other = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        again = llm.generate(prompt, GREEDY, use_tqdm=False,
                             lora_request=LoRARequest("a1", 1, paths["a1"]))[0]
    assert first.num_cached_tokens == 0 and other.num_cached_tokens == 0
    assert again.num_cached_tokens > 0  # its own adapter's blocks hit
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_adapters_are_refused_naming_them(case, tmp_path):
    base, paths, _, family = case
    if family != "llama":
        pytest.skip("one family shows the checks")
    big = str(tmp_path / "big")
    shutil.copytree(paths["a1"], big)
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        LLM(base, **ENGINE | {"max_lora_rank": 4, "lora_modules": [f"big={big}"]})
    embed = str(tmp_path / "embed")
    shutil.copytree(paths["a1"], embed)
    config_file = os.path.join(embed, "adapter_config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["target_modules"] = ["embed_tokens", "q_proj"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="targets embed_tokens"):
        LLM(base, **ENGINE | {"lora_modules": [f"embed={embed}"]})
    with pytest.raises(ValueError, match="no adapter_config.json"):
        LLM(base, **ENGINE | {"lora_modules": [f"gone={tmp_path / 'gone'}"]})
    with LLM(base, **{k: v for k, v in ENGINE.items() if k != "enable_lora"}) as llm:
        with pytest.raises(ValueError, match="enable_lora"):
            generate(llm, LoRARequest("a1", 1, paths["a1"]))


def test_an_adapter_of_another_base_is_refused(case, tmp_path):
    """An adapter trained on a model of other sizes does not fit: the request's error,
    naming the adapter, and the engine serves on."""
    base, paths, want, family = case
    if family != "llama":
        pytest.skip("one family shows the check")
    other = make_tiny_tokenizer(make_tiny_checkpoint("llama", tmp_path / "other",
                                                     hidden_size=32, intermediate_size=64))
    make_adapter(other, str(tmp_path / "foreign"), 3, 4, ATTENTION)
    with LLM(base, **ENGINE) as llm:
        with pytest.raises(Exception, match="do not fit this base"):
            generate(llm, LoRARequest("foreign", 9, str(tmp_path / "foreign")))
        assert generate(llm, None) == want[None]


def test_a_lora_forward_replays_natively(case, monkeypatch):
    """bf16 on the CPU: a step's adapters run in loom's lora_add kernel, so a recorded
    forward holds them and replays them (each token's slot an input of the replay), with
    the modules' tokens, batches mixing adapters and the base included."""
    from loom.envs import settings
    from loom.kernels import native_ops
    from loom.model import kernel_replay

    base, paths, _, family = case
    ops = native_ops()
    if family != "llama" or ops is None or not ops.bf16_gemm_available():
        pytest.skip("one family on the native bf16 kernels shows it")
    monkeypatch.setattr(kernel_replay, "RECORD_AFTER", 0)
    a1, a2 = LoRARequest("a1", 1, paths["a1"]), LoRARequest("a2", 2, paths["a2"])
    tokens = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("LOOM_NATIVE_LAYERS", setting)
        settings.cache_clear()
        with LLM(base, **ENGINE | {"dtype": "bfloat16"}) as llm:
            tokens[setting] = generate(llm, [a1, None, a2]) + generate(llm, [a2, a2, a1])
            model = llm.engine.engine_core.executor.worker.model_runner.model
            replay = getattr(model, "kernel_replay", None)
            assert (replay is not None and replay.refusal is None
                    and replay.stats.replayed > 0) == (setting == "1")
    assert tokens["0"] == tokens["1"]


def test_a_quantized_base_with_an_adapter_equals_its_dequantized_self(case, tmp_path):
    """QLoRA's deployment: a wint4 base (its linears in groups of 32, its tables wint8,
    quantized at load) with a full-precision adapter gives transformers' tokens on the
    same weights dequantized, with PEFT's adapter merged on top."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loom.model.layers.quantization import quantize_wint4, quantize_wint8

    base, paths, _, family = case
    if family != "llama":
        pytest.skip("one family shows it")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ALL:
                module.weight.copy_(quantize_wint4(module.weight, 32).dequantize())
        tables = {id(t): t for t in (model.get_input_embeddings().weight,
                                     model.get_output_embeddings().weight)}
        for table in tables.values():
            table.copy_(quantize_wint8(table).dequantize())
    dequantized = str(tmp_path / "dequantized")
    model.save_pretrained(dequantized, safe_serialization=True)
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32),
        paths["a1"]).merge_and_unload().eval()
    want = [hf_greedy(merged, p) for p in PROMPTS]
    with LLM(base, quantization="wint4", quantization_group_size=32, **ENGINE) as llm:
        assert generate(llm, LoRARequest("a1", 1, paths["a1"])) == want
    assert want != case[2]["a1"]  # the test has teeth: the quantized base answers otherwise
