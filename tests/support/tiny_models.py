"""Tiny models built on the fly for tests: real Hugging Face directories, no download needed.

A test builds one into ``tmp_path`` and loads it back through the engines like any model on disk.
"""

from __future__ import annotations

from pathlib import Path

TINY_EOS = "<|endoftext|>"
"""End-of-sequence token of the tiny causal LM's tokenizer; it has no pad token."""

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}; {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The tiny tokenizer's chat template: ``[{"role": "user", "content": "Hi"}]`` renders as ``user: Hi; assistant:``
with the generation prompt. A separator of printable ASCII, not a newline, which the vocabulary lacks."""


def build_tiny_causal_lm(directory: Path, *, n_positions: int = 128, n_layer: int = 2, n_embd: int = 32) -> Path:
    """Save a randomly initialised (seeded) two-layer GPT-2 and its tokenizer into ``directory``.

    The tokenizer has one token per printable ASCII character, so prompt lengths are easy to reason
    about and every generated token decodes to readable text; it has a chat template too
    (`TINY_CHAT_TEMPLATE`), for task ``chat``. ``n_positions`` is its context in tokens;
    ``n_layer`` and ``n_embd`` its depth and width (smaller runs a long prompt faster).
    """
    import torch
    from tokenizers import Tokenizer, decoders, models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, TINY_EOS: 1}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<unk>", TINY_EOS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=TINY_EOS, unk_token="<unk>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE

    config = GPT2Config(
        vocab_size=len(vocab),
        n_layer=n_layer,
        n_head=1 if n_embd < 32 else 2,
        n_embd=n_embd,
        n_positions=n_positions,
        bos_token_id=vocab[TINY_EOS],
        eos_token_id=vocab[TINY_EOS],
        # Wide initial weights give peaked logits, so greedy decoding has no near-ties that
        # padding's rounding differences could flip.
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_classifier(directory: Path, labels: list[str], *, max_positions: int = 64) -> Path:
    """Save a randomly initialised (seeded) two-layer multi-label BERT classifier over ``labels``, and a
    tokenizer of one token per printable ASCII character, into ``directory``."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="[UNK]"))
    backend.add_special_tokens(["[PAD]", "[UNK]"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        id2label=dict(enumerate(labels)),
        label2id={label: index for index, label in enumerate(labels)},
        problem_type="multi_label_classification",
        initializer_range=0.5,
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
