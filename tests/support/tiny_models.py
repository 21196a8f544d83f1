"""Tiny models built on the fly for tests: real Hugging Face directories, no download needed.

A test builds one into ``tmp_path`` and loads it back through the engines like any model on disk.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY_EOS = "<|endoftext|>"
"""End-of-sequence token of the tiny causal LM's tokenizer; it has no pad token."""

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}; {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""The tiny tokenizer's chat template: ``[{"role": "user", "content": "Hi"}]`` renders as ``user: Hi; assistant:``
with the generation prompt. A separator of printable ASCII, not a newline, which the vocabulary lacks."""


def _char_tokenizer() -> Any:
    """One token per printable ASCII character, an end-of-sequence token, and `TINY_CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, TINY_EOS: 1}
    for code in range(32, 127):
        vocab[chr(code)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<unk>", TINY_EOS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=TINY_EOS, unk_token="<unk>")
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def _saved(model_class: Any, config: Any, tokenizer: Any, directory: Path) -> Path:
    """A model of ``config``, its weights drawn from a fixed seed, saved with ``tokenizer`` into ``directory``."""
    import torch

    torch.manual_seed(0)
    model = model_class(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def build_tiny_causal_lm(
    directory: Path, *, n_positions: int = 128, n_layer: int = 2, n_embd: int = 32, n_head: int | None = None
) -> Path:
    """Save a randomly initialised (seeded) two-layer GPT-2 and its tokenizer into ``directory``.

    The tokenizer has one token per printable ASCII character, so prompt lengths are easy to reason
    about and every generated token decodes to readable text; it has a chat template too
    (`TINY_CHAT_TEMPLATE`), for task ``chat``. ``n_positions`` is its context in tokens;
    ``n_layer`` and ``n_embd`` its depth and width (smaller runs a long prompt faster); ``n_head`` its attention
    heads (by default 1 under a width of 32, else 2; vLLM's CPU attention wants heads of 32 or more).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = _char_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_layer=n_layer,
        n_head=n_head or (1 if n_embd < 32 else 2),
        n_embd=n_embd,
        n_positions=n_positions,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # Wide initial weights give peaked logits, so greedy decoding has no near-ties that
        # padding's rounding differences could flip.
        initializer_range=0.5,
    )
    return _saved(GPT2LMHeadModel, config, tokenizer, directory)


def build_tiny_llama(directory: Path, *, attention_heads: int = 4, positions: int = 128) -> Path:
    """A two-layer Llama of `build_tiny_causal_lm`'s tokenizer: the shape vLLM serves LoRA adapters on (its
    GPT-2 takes none). Its width is 64; one attention head makes heads of 64, as vLLM's CPU attention wants.
    ``positions`` is its context in tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=attention_heads,
        num_key_value_heads=attention_heads,
        max_position_embeddings=positions,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        initializer_range=0.5,
    )
    return _saved(LlamaForCausalLM, config, tokenizer, directory)


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


def build_tiny_lora(base: Path, directory: Path, *, seed: int, rank: int = 4) -> Path:
    """Save a LoRA adapter of the tiny causal LM at ``base`` (GPT-2 or Llama) into ``directory`` (PEFT's
    layout, safetensors): random A and B matrices on the attention's projections, seeded, large enough to
    change greedy answers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    if model.config.model_type == "gpt2":
        # GPT-2's attention is a Conv1D, which keeps its weight as (in, out): fan_in_fan_out.
        targets, fan_in_fan_out = ["c_attn"], True
    else:
        targets, fan_in_fan_out = ["q_proj", "v_proj"], False
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets,
        init_lora_weights=False,
        fan_in_fan_out=fan_in_fan_out,
    )
    torch.manual_seed(seed)
    adapted = get_peft_model(model, config)
    adapted.save_pretrained(str(directory))
    return directory


def save_perturbed_copy(source: Path, directory: Path, *, scale: float, seed: int = 1) -> Path:
    """Load the Hugging Face model in ``source``, add Gaussian noise of ``scale`` (seeded) to each of its
    weight matrices, and save it with its tokenizer into ``directory``: the same model retrained a little."""
    import shutil

    import torch
    import transformers

    # The class the model was saved from (its head included), as its config names it.
    architecture = transformers.AutoConfig.from_pretrained(source).architectures[0]
    model = getattr(transformers, architecture).from_pretrained(source)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    shutil.copytree(source, directory, dirs_exist_ok=True)
    model.save_pretrained(directory)
    return directory


def write_lora_files(directory: Path, *, rank: int = 8, module: str = "model.layers.0.self_attn.q_proj") -> Path:
    """A LoRA adapter's two files in PEFT's layout without a base model at hand (one module, zero matrices):
    enough for an engine that checks the files before handing them to a fake vLLM."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [module.rsplit(".", 1)[-1]]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    prefix = f"base_model.model.{module}"
    save_file(
        {f"{prefix}.lora_A.weight": torch.zeros(rank, 16), f"{prefix}.lora_B.weight": torch.zeros(16, rank)},
        str(directory / "adapter_model.safetensors"),
    )
    return directory
