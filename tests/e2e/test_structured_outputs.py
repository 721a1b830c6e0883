"""Structured outputs offline: a random tiny model can only produce what the grammar
allows, so every constrained output must parse and validate, batched with plain ones;
with xgrammar, llguidance, and auto's choice between them."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from loom import LLM, SamplingParams
from loom.input_processor import InvalidInputError
from loom.sampling_params import StructuredOutputsParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"},
                 "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["red", "green", "blue"]
GBNF = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num){0,4}\nnum ::= [1-9] [0-9]?'
GBNF_AS_REGEX = r"\([1-9][0-9]?([+*][1-9][0-9]?){0,4}\)"


@pytest.fixture(scope="module")
def engines(tiny_llama):
    """One engine per --structured-outputs-backend, started on first use."""
    started: dict[str, LLM] = {}

    def engine(backend: str = "auto") -> LLM:
        if backend not in started:
            started[backend] = LLM(tiny_llama, dtype="float32", max_model_len=512, seed=0,
                                   structured_outputs_backend=backend)
        return started[backend]

    yield engine
    for started_engine in started.values():
        started_engine.shutdown()


@pytest.fixture(scope="module")
def llm(engines):
    return engines("auto")


def _constraints():
    return [
        ("json", StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)),
        ("json_ws", StructuredOutputsParams(json=PERSON)),  # bounded free whitespace
        ("regex", StructuredOutputsParams(regex=REGEX)),
        ("choice", StructuredOutputsParams(choice=CHOICES)),
        ("grammar", StructuredOutputsParams(grammar=GBNF)),
        ("json_object", StructuredOutputsParams(json_object=True, disable_any_whitespace=True)),
    ]


def _check(kind: str, text: str) -> None:
    if kind.startswith("json"):
        value = json.loads(text)
        if kind == "json_object":
            assert isinstance(value, dict)
        else:
            jsonschema.validate(value, PERSON)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES
    else:
        assert re.fullmatch(GBNF_AS_REGEX, text), text


@pytest.mark.parametrize("backend, temperature, seed", [
    ("auto", 0.0, 0),  # greedy output ignores the seed
    ("xgrammar", 1.0, 0), ("guidance", 1.0, 1)])
def test_constrained_outputs_validate_in_a_batch_with_plain_ones(engines, backend, temperature,
                                                                 seed):
    llm = engines(backend)
    constraints = _constraints()
    seeds = [seed]
    prompts, params = [], []
    for seed in seeds:
        for kind, constraint in constraints:
            prompts.append(f"{kind} {seed}")
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=480,
                                         structured_outputs=constraint))
        prompts.append(f"plain {seed}")
        params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=12,
                                     ignore_eos=True))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    kinds = [kind for _ in seeds for kind in [k for k, _ in constraints] + ["plain"]]
    for kind, output in zip(kinds, outputs):
        completion = output.outputs[0]
        if kind == "plain":
            assert completion.finish_reason == "length" and len(completion.token_ids) == 12
            continue
        assert completion.finish_reason == "stop", (kind, completion.text)
        _check(kind, completion.text)


def test_n_sequences_and_chat_follow_the_grammar(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=100,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    [output] = llm.generate("emails", params, use_tqdm=False)
    assert len(output.outputs) == 3
    for completion in output.outputs:
        assert re.fullmatch(REGEX, completion.text) and completion.finish_reason == "stop"
    [chat] = llm.chat([{"role": "user", "content": "pick a colour"}],
                      SamplingParams(temperature=1.0, seed=1, max_tokens=20,
                                     structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                      use_tqdm=False)
    assert chat.outputs[0].text in CHOICES


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])  # checked by llguidance, xgrammar
@pytest.mark.parametrize("constraint", [
    StructuredOutputsParams(json={"type": "nonsense"}),
    StructuredOutputsParams(regex="(unclosed"),
    StructuredOutputsParams(grammar="root ::= missing"),
])
def test_malformed_constraints_are_rejected_before_the_engine(engines, backend, constraint):
    llm = engines(backend)
    with pytest.raises(InvalidInputError) as info:
        llm.generate("x", SamplingParams(structured_outputs=constraint), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    # The engine is unharmed.
    [output] = llm.generate("x", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_tokenizer_whose_decoder_llguidance_cannot_read(tmp_path, backend):
    """A SentencePiece-style tokenizer with the Metaspace decoder (as some conversions of
    ERNIE-, Llama- and Gemma-style tokenizers ship it): its token table comes from its own
    decoding, and constrained outputs validate (before: the grammar failed to compile)."""
    from checkpoints import make_tiny_checkpoint
    from tokenizer_fixtures import make_tiny_metaspace_tokenizer

    tokenizer = make_tiny_metaspace_tokenizer(str(tmp_path / "tokenizer"))
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint("llama", tmp_path / "model",
                                vocab_size=len(AutoTokenizer.from_pretrained(tokenizer)) + 4)
    engine = LLM(path, tokenizer=tokenizer, dtype="float32", max_model_len=512, seed=0,
                 structured_outputs_backend=backend)
    try:
        kinds = ["json", "regex", "choice", "grammar"]  # bounded: a random model ends them
        params = [SamplingParams(temperature=0.0, max_tokens=480, structured_outputs=c)
                  for kind, c in _constraints() if kind in kinds]
        outputs = engine.generate([f"{kind}:" for kind in kinds], params, use_tqdm=False)
    finally:
        engine.shutdown()
    for kind, output in zip(kinds, outputs):
        assert output.outputs[0].finish_reason == "stop", (kind, output.outputs[0].text)
        _check(kind, output.outputs[0].text)


def test_backend_off_loads_no_grammar_engine(tiny_llama):
    """--structured-outputs-backend off offline: no grammar manager in the engine core, a
    constrained request refused naming the flag, a plain one served."""
    engine = LLM(tiny_llama, dtype="float32", max_model_len=128, structured_outputs_backend="off")
    try:
        assert engine.engine.engine_core.structured_output is None
        with pytest.raises(InvalidInputError, match="--structured-outputs-backend off"):
            engine.generate(["hi"], SamplingParams(
                max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["a"])),
                use_tqdm=False)
        output = engine.generate(["hi"], SamplingParams(max_tokens=3, ignore_eos=True),
                                 use_tqdm=False)
        assert len(output[0].outputs[0].token_ids) == 3
    finally:
        engine.shutdown()
