"""Tiny random encoder checkpoints (BERT, ModernBERT, RoBERTa, XLM-RoBERTa, ELECTRA) with
their tokenizers, built offline: embedding models saved as sentence-transformers
directories (modules.json, the Pooling module's config, a Normalize), classifiers as
transformers saves them (a one-label classifier is a cross-encoder for
sentence-transformers' CrossEncoder).

BERT's, ModernBERT's and ELECTRA's tokenizer is transformers' BertTokenizer over a
handmade vocabulary: [PAD] 0, [UNK] 1, [CLS] 2, [SEP] 3, [MASK] 4, then WORDS and a few
``##`` pieces; a pair encodes as ``[CLS] a [SEP] b [SEP]`` with token types 0 then 1.
RoBERTa's and XLM-RoBERTa's is XLM-RoBERTa's (a Unigram model): <s> 0, <pad> 1, </s> 2,
<unk> 3, then ``▁`` and WORDS each as a word, single characters, <mask>; a pair encodes
as ``<s> a </s></s> b </s>`` with no token types.
"""

from __future__ import annotations

import json
import os

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the cat sat on mat hello world a b c d e f g h i j k l m n o p q r s t u v w x y z "
         "what where dog runs fast and then some more words query document is about of to "
         "in it").split()
PIECES = ["##s", "##ing", "##ed", ",", ".", "?"]
VOCAB = SPECIAL + WORDS + PIECES
HIDDEN = 64


def make_wordpiece_tokenizer(path: str) -> str:
    from transformers import BertTokenizer

    tokenizer = BertTokenizer(vocab={token: i for i, token in enumerate(VOCAB)},
                              model_max_length=512)
    tokenizer.save_pretrained(path)
    return path


def make_unigram_tokenizer(path: str) -> str:
    from transformers import XLMRobertaTokenizer

    vocab = ([(token, 0.0) for token in ("<s>", "<pad>", "</s>", "<unk>")] + [("▁", -2.0)]
             + [("▁" + word, -1.0) for word in WORDS]
             + [(char, -5.0) for char in "abcdefghijklmnopqrstuvwxyz?.,"] + [("<mask>", 0.0)])
    XLMRobertaTokenizer(vocab=vocab, model_max_length=512).save_pretrained(path)
    return path


def bert_config(**overrides):
    from transformers import BertConfig

    return BertConfig(**{"vocab_size": len(VOCAB), "hidden_size": HIDDEN,
                         "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 128, "max_position_embeddings": 128,
                         "type_vocab_size": 2, "pad_token_id": 0} | overrides)


def electra_config(**overrides):
    from transformers import ElectraConfig

    # embeddings narrower than the layers, as ELECTRA-small's: embeddings_project between
    return ElectraConfig(**{"vocab_size": len(VOCAB), "embedding_size": 32,
                            "hidden_size": HIDDEN, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 128,
                            "max_position_embeddings": 128, "type_vocab_size": 2,
                            "pad_token_id": 0} | overrides)


def modernbert_config(**overrides):
    from transformers import ModernBertConfig

    # 4 layers: 0 and 3 global, 1 and 2 local with a window of 4 tokens each side, so a
    # prompt of more than 5 tokens reads differently through the two kinds
    return ModernBertConfig(**{"vocab_size": len(VOCAB), "hidden_size": HIDDEN,
                               "intermediate_size": 96, "num_hidden_layers": 4,
                               "num_attention_heads": 4, "local_attention": 8,
                               "max_position_embeddings": 128, "pad_token_id": 0,
                               "bos_token_id": 2, "cls_token_id": 2, "eos_token_id": 3,
                               "sep_token_id": 3} | overrides)


def roberta_config(family: str = "roberta", **overrides):
    from transformers import RobertaConfig, XLMRobertaConfig

    # as the released checkpoints: one token type, positions from pad_token_id + 1 (so
    # 130 rows for prompts of 128 tokens)
    config = RobertaConfig if family == "roberta" else XLMRobertaConfig
    return config(**{"vocab_size": len(WORDS) + 35, "hidden_size": HIDDEN,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "intermediate_size": 128, "max_position_embeddings": 130,
                     "type_vocab_size": 1, "pad_token_id": 1, "bos_token_id": 0,
                     "eos_token_id": 2, "layer_norm_eps": 1e-5} | overrides)


ROBERTA_FAMILIES = ("roberta", "xlm-roberta")


def _config(family: str, **overrides):
    if family in ROBERTA_FAMILIES:
        return roberta_config(family, **overrides)
    return {"bert": bert_config, "electra": electra_config,
            "modernbert": modernbert_config}[family](**overrides)


def _tokenizer(path: str, family: str) -> str:
    return (make_unigram_tokenizer if family in ROBERTA_FAMILIES
            else make_wordpiece_tokenizer)(path)


def write_sentence_transformers(path: str, pooling: str, normalize: bool,
                                hidden_size: int) -> str:
    """The sentence-transformers files of ``path``'s checkpoint: a Transformer, a
    Pooling module (``last``, ``mean`` or ``cls``) over ``hidden_size`` features, and a
    Normalize if asked."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
        os.makedirs(os.path.join(path, "2_Normalize"), exist_ok=True)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": hidden_size,
                   "pooling_mode_cls_token": pooling == "cls",
                   "pooling_mode_mean_tokens": pooling == "mean",
                   "pooling_mode_max_tokens": False,
                   "pooling_mode_lasttoken": pooling == "last", "include_prompt": True}, f)
    return path


def make_embedding_model(path: str, family: str, pooling: str, normalize: bool = True,
                         **overrides) -> str:
    """A sentence-transformers directory: a random ``BertModel``, ``ModernBertModel``,
    ``RobertaModel`` or ``XLMRobertaModel`` (``overrides``: its config's values other
    than the tiny ones), its tokenizer, a Pooling module (``cls`` or ``mean``), a
    Normalize if asked."""
    import torch
    from transformers import AutoModel

    torch.manual_seed(0)
    config = _config(family, **overrides)
    model = AutoModel.from_config(config)
    model.save_pretrained(path)
    _tokenizer(path, family)
    write_sentence_transformers(path, pooling, normalize, config.hidden_size)
    with open(os.path.join(path, "sentence_bert_config.json"), "w") as f:
        json.dump({"max_seq_length": 128,
                   "do_lower_case": False}, f)
    return path


def make_classifier(path: str, family: str, num_labels: int = 1, **overrides) -> str:
    """A random ``*ForSequenceClassification`` (num_labels 1: a cross-encoder) with its
    classifier's weights spread wide and its bias centring a pair's logits on 0, so
    that scores differ visibly and a sigmoid of them is not saturated."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(
        _config(family, num_labels=num_labels, **overrides)).eval()
    tokenizer = AutoTokenizer.from_pretrained(_tokenizer(path, family))
    # the output layer and the dense layer before it (BERT's pooler, RoBERTa's and
    # ELECTRA's head)
    if hasattr(model.classifier, "out_proj"):
        output, dense = model.classifier.out_proj, model.classifier.dense
    else:
        output, dense = model.classifier, model.bert.pooler.dense if family == "bert" else None
    with torch.no_grad():
        output.weight.normal_(0, 0.5)
        if dense is not None:
            dense.weight.normal_(0, 0.5)
        output.bias -= model(**tokenizer("a b", "c d", return_tensors="pt")).logits[0]
    model.save_pretrained(path)
    return path
