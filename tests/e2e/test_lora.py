"""LoRA adapters (loom/lora.py): greedy tokens with an adapter equal transformers + PEFT's
merged model (float32) for dense families, a mixture of experts' attention and ERNIE 4.5
MoE's attention and shared experts (its routed experts refused), with adapters on the
embeddings and the LM head too; a batch mixing two adapters and the
base equals each served alone; more adapters than slots queue and swap, each step
running at most max_loras of them, with fewer held in host memory than served (read
again from disk); an adapter updated in place while another's request runs; prefix
caching does not share blocks across adapters; each bad adapter is refused naming it;
tensor parallel over 2 ranks gives the same tokens, and a wint4 base with an adapter its
dequantized self with it merged. (The server: tests/entrypoints/test_lora_serving.py.)"""

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
    config["target_modules"] = ["gate", "q_proj"]  # a MoE router
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="targets gate;"):
        LLM(base, **ENGINE | {"lora_modules": [f"embed={embed}"]})
    with pytest.raises(ValueError, match="no adapter_config.json"):
        LLM(base, **ENGINE | {"lora_modules": [f"gone={tmp_path / 'gone'}"]})
    saved = str(tmp_path / "saved")
    shutil.copytree(paths["a1"], saved)
    config["target_modules"], config["modules_to_save"] = ["q_proj"], ["lm_head"]
    with open(os.path.join(saved, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"copies of lm_head \(modules_to_save\).*in "
                                         "target_modules instead"):
        LLM(base, **ENGINE | {"lora_modules": [f"saved={saved}"]})
    with pytest.raises(ValueError, match="--max-cpu-loras 1 is below --max-loras 2"):
        LLM(base, **ENGINE | {"max_cpu_loras": 1})
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


def test_more_adapters_than_slots_queue_and_swap(case, tmp_path, monkeypatch):
    """max_loras=1 and three adapters, requests interleaved: each waits until its adapter
    can have the slot (no step runs two), the rank swaps adapters in as their requests
    run, and with max_cpu_loras=2 the one dropped from host memory is read from disk
    again; every request's tokens are its adapter's, as PEFT's merged model gives them."""
    base, paths, want, family = case
    if family != "llama":
        pytest.skip("one family shows it")
    merged = make_adapter(base, str(tmp_path / "a3"), 3, 8, ["q_proj", "down_proj"])
    want = want | {"a3": [hf_greedy(merged, p) for p in PROMPTS]}
    paths = paths | {"a3": str(tmp_path / "a3")}
    names = ["a1", "a2", "a3", "a1", "a2", "a3"]
    with LLM(base, **ENGINE | {"max_loras": 1, "max_cpu_loras": 2}) as llm:
        core = llm.engine.engine_core
        step_adapters = []
        execute = core.executor.execute_model

        def spy(scheduler_output):
            step_adapters.append({core.scheduler.requests[r].sampling_params.lora_name
                                  for r in scheduler_output.num_scheduled_tokens} - {None})
            return execute(scheduler_output)

        monkeypatch.setattr(core.executor, "execute_model", spy)
        prompts = [{"prompt_token_ids": PROMPTS[i % 3]} for i in range(6)]
        outputs = llm.generate(prompts + [{"prompt_token_ids": PROMPTS[0]}], GREEDY,
                               use_tqdm=False, lora_request=[
                                   LoRARequest(name, 1, paths[name]) for name in names] + [None])
        stats = llm.collective_rpc("lora_stats")[0]
    assert [o.outputs[0].token_ids for o in outputs] == [
        want[name][i % 3] for i, name in enumerate(names)] + [want[None][0]]
    assert max(len(adapters) for adapters in step_adapters) == 1
    assert len(stats["held"]) == 2 and len(stats["slots"]) == 1
    assert stats["slot_loads"] >= 3 and stats["disk_reads"] > 3  # read again after a drop


def test_an_adapter_updated_while_another_streams(case, tmp_path):
    """LLM.update_weights(path, lora_name=...) while a request on another adapter is
    running: nothing is drained, that request's tokens are those it gives alone, and the
    updated adapter's next request gives the new weights' tokens (PEFT's merged model),
    none of its old prefix blocks reused."""
    base, paths, want, family = case
    if family != "llama":
        pytest.skip("one family shows it")
    merged = make_adapter(base, str(tmp_path / "new"), 7, 8, ALL)
    prompt = list(range(40, 80))  # whole blocks, cached under the old weights
    want_new = hf_greedy(merged, prompt)
    long = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(base, **ENGINE) as llm:
        a1, a2 = LoRARequest("a1", 1, paths["a1"]), LoRARequest("a2", 2, paths["a2"])
        before = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                              lora_request=a1)[0].outputs[0].token_ids
        alone = llm.generate({"prompt_token_ids": PROMPTS[1]}, long, use_tqdm=False,
                             lora_request=a2)[0].outputs[0].token_ids
        engine = llm.engine
        engine.add_request("streaming", {"prompt_token_ids": PROMPTS[1]},
                           long.clone(lora_name="a2"), stream=True)
        streamed: list[int] = []
        while len(streamed) < 4:
            for output in engine.step():
                streamed += output.outputs[0].token_ids
        reads = llm.collective_rpc("lora_stats")[0]["disk_reads"]
        llm.update_weights(str(tmp_path / "new"), lora_name="a1")
        assert engine.has_unfinished_requests()  # a2's request runs on
        while engine.has_unfinished_requests():
            for output in engine.step():
                streamed += output.outputs[0].token_ids
        after = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                             lora_request=LoRARequest("a1", 1, str(tmp_path / "new")))[0]
        assert llm.collective_rpc("lora_stats")[0]["disk_reads"] == reads + 1  # the update
        with pytest.raises(ValueError, match="no LoRA adapter 'a9' is served"):
            llm.update_weights(str(tmp_path / "new"), lora_name="a9")
        with pytest.raises(ValueError, match="does not fit|do not fit"):
            other = make_tiny_tokenizer(make_tiny_checkpoint(
                "llama", tmp_path / "other", hidden_size=32, intermediate_size=64))
            make_adapter(other, str(tmp_path / "foreign"), 3, 4, ATTENTION)
            llm.update_weights(str(tmp_path / "foreign"), lora_name="a1")
        still = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False,
                             lora_request=LoRARequest("a1", 1, str(tmp_path / "new")))[0]
    assert streamed == alone
    assert after.outputs[0].token_ids == want_new != before
    assert after.num_cached_tokens == 0  # the old weights' blocks are not the new ones'
    assert still.outputs[0].token_ids == want_new  # a refused update changed nothing


@pytest.fixture(scope="module")
def tables_case(tmp_path_factory):
    """A llama base and an adapter on its embeddings, its LM head and q_proj."""
    root = tmp_path_factory.mktemp("tables")
    base = make_tiny_tokenizer(make_tiny_checkpoint("llama", root / "base"))
    merged = make_adapter(base, str(root / "tables"), 4, 8, ["embed_tokens", "lm_head",
                                                              "q_proj"])
    return base, str(root / "tables"), [hf_greedy(merged, p) for p in PROMPTS]


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_on_the_embeddings_and_the_lm_head(tables_case, tp):
    """PEFT's embedding adapter (lora_embedding_A/B) and an LM head adapter: PEFT's merged
    tokens, over one rank and two (the head's B cut by vocabulary range), beside the base
    in one batch."""
    base, path, want = tables_case
    tables = LoRARequest("tables", 1, path)
    with LLM(base, tensor_parallel_size=tp, **ENGINE) as llm:
        assert generate(llm, tables) == want
        mixed = generate(llm, [None, tables, None])
        plain = generate(llm, None)
    assert mixed == [plain[0], want[1], plain[2]] and plain != want


def test_table_adapters_replay_natively(tables_case, monkeypatch):
    """bf16 on the CPU: the embedding's adapter runs in loom's lora_embedding_add kernel
    inside the replayed forward (the same tokens as the modules give)."""
    from loom.envs import settings
    from loom.kernels import native_ops
    from loom.model import kernel_replay

    base, path, _ = tables_case
    ops = native_ops()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("the native bf16 kernels show it")
    monkeypatch.setattr(kernel_replay, "RECORD_AFTER", 0)
    tables = LoRARequest("tables", 1, path)
    tokens = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("LOOM_NATIVE_LAYERS", setting)
        settings.cache_clear()
        with LLM(base, **ENGINE | {"dtype": "bfloat16"}) as llm:
            tokens[setting] = generate(llm, [tables, None, tables]) + generate(llm, tables)
            model = llm.engine.engine_core.executor.worker.model_runner.model
            replay = getattr(model, "kernel_replay", None)
            assert (replay is not None and replay.refusal is None
                    and replay.stats.replayed > 0) == (setting == "1")
    assert tokens["0"] == tokens["1"]


@pytest.fixture(scope="module")
def shared_experts_case(tmp_path_factory):
    return make_shared_experts_case(tmp_path_factory.mktemp("shared_experts"))


def make_shared_experts_case(root):
    """ERNIE 4.5 MoE (a dense first layer, then MoE layers with shared experts) with a
    rank-8 adapter on its attention, its shared experts' gate/up/down_proj and the dense
    layer's MLP, PEFT's merged tokens for it, and PEFT's own adapter for the same targets.

    PEFT 0.21 under transformers 5 turns gate/up/down_proj targets of an MoE family into
    the routed experts' fused parameters (target_parameters: what PEFT makes by default,
    the second adapter); the first is the adapter PEFT makes by module name, as under
    transformers 4 (that conversion off): the shared experts' and dense MLP's linears."""
    import peft.utils.transformers_weight_conversion as conversion

    base = make_tiny_tokenizer(make_tiny_checkpoint("ernie4_5_moe", root / "base"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(conversion, "convert_peft_config_for_transformers", lambda *a, **k: None)
        merged = make_adapter(base, str(root / "shared"), 6, 8, ALL)
    make_adapter(base, str(root / "routed"), 7, 4, ALL)
    want = []
    with torch.no_grad():  # argmax of each step's logits, EOS included (no min_new_tokens)
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            for _ in range(GREEDY.max_tokens):
                ids = torch.cat([ids, merged(ids).logits[:, -1:].argmax(-1)], dim=1)
            want.append(ids[0, len(prompt):].tolist())
    return base, str(root / "shared"), str(root / "routed"), want


def test_adapters_on_shared_experts_equal_peft_merged(shared_experts_case, tmp_path):
    """An MoE's shared experts (and dense layers' MLPs) take an adapter's gate/up/down_proj
    by module name: PEFT's merged tokens, beside the base in one batch; the routed
    experts take none: PEFT's fused-parameter adapter and an adapter naming one expert's
    projection are each refused, naming what they target."""
    from safetensors.torch import load_file, save_file

    base, shared, routed, want = shared_experts_case
    expert = str(tmp_path / "expert")
    shutil.copytree(shared, expert)
    file = os.path.join(expert, "adapter_model.safetensors")
    save_file({key.replace("layers.1.mlp.shared_experts.", "layers.1.mlp.experts.3."): tensor
               for key, tensor in load_file(file).items()}, file)
    with LLM(base, **ENGINE) as llm:
        assert generate(llm, LoRARequest("shared", 1, shared)) == want
        mixed = generate(llm, [LoRARequest("shared", 1, shared), None,
                               LoRARequest("shared", 1, shared)])
        plain = generate(llm, None)
        with pytest.raises(ValueError, match=r"LoRA on parameters \(experts\) "
                                             r"\(target_parameters\)"):
            generate(llm, LoRARequest("routed", 2, routed))
        with pytest.raises(ValueError, match=r"targets model.layers.1.mlp.experts.3.\w+_proj, a "
                                             "routed expert"):
            generate(llm, LoRARequest("expert", 3, expert))
    assert mixed == [want[0], plain[1], want[2]] and plain != want


@pytest.mark.parametrize("family", ["qwen2", "mistral_sliding", "gemma3", "ernie4_5"])
def test_every_other_dense_family_equals_peft_merged(family, tmp_path):
    """The families the module's cases leave out: an adapter on every linear gives the
    PEFT-merged model's greedy tokens, beside the base in the same batch."""
    from transformers import AutoModelForCausalLM

    base = make_tiny_tokenizer(make_tiny_checkpoint(family, tmp_path / "base"))
    merged = make_adapter(base, str(tmp_path / "a1"), 1, 8, ALL)
    plain = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    want = [hf_greedy(merged, PROMPTS[0]), hf_greedy(plain, PROMPTS[1])]
    assert want[0] != hf_greedy(plain, PROMPTS[0])  # the adapter changes the tokens
    with LLM(base, **ENGINE) as llm:
        got = generate(llm, [LoRARequest("a1", 1, str(tmp_path / "a1")), None, None])
    assert got[:2] == want
