"""Test factories: a tiny random Llama-architecture model with a real (trained) BPE
tokenizer, written to a directory in about a second, so unit tests never need the demo model."""

from __future__ import annotations

import json
from pathlib import Path

from quantgate.calibration.sources import demo_source_dir

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
)


def demo_paragraphs(limit: int | None = None) -> list[str]:
    with open(demo_source_dir() / "paragraphs.jsonl", encoding="utf-8") as stream:
        texts = [json.loads(line)["text"] for line in stream]
    return texts[:limit] if limit else texts


def build_tokenizer(path: Path, vocab_size: int = 512, chat_template: bool = True) -> None:
    """Train a byte-level BPE on demo text and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(demo_paragraphs(200), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<|endoftext|>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        clean_up_tokenization_spaces=False,
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)


def build_tiny_llama(
    path: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 256,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    tokenizer: bool = True,
) -> Path:
    """A random LlamaForCausalLM in BF16 safetensors, with tokenizer and generation config."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        build_tokenizer(path, vocab_size)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig.from_model_config(config).save_pretrained(path)
    return path
