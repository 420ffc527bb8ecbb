"""Tiny random models of six transformers families, built from their configs (no download), for
the architecture matrix (tests/test_architectures.py, docs/architectures.md).

Each keeps what makes its family different to quantize, measure and serve: Qwen2's q/k/v biases,
untied head and grouped-query attention; Gemma 3's sliding-window layers, tied embeddings and
(1 + weight) norms around each sublayer; Phi-3's fused qkv_proj and gate_up_proj; GPT-NeoX's
query_key_value and dense_h_to_4h with biases, parallel residual and untied `embed_out` head;
Qwen2-MoE's routed experts, shared expert and routers. Sizes are as small as the formats allow:
a hidden size of 64 takes INT4 groups of 64 (quantize.groups' fallback), an intermediate size of
128 (or a multiple) the requested 128.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.factories import build_tokenizer

VOCAB = 512
# the shared tokenizer's special tokens (tests.factories.SPECIAL_TOKENS): ids 0, 1, 2
TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
# Two heads of 32 (vLLM's CPU attention takes head sizes from 32 up), one key-value head where the
# family has grouped-query attention.
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
          "max_position_embeddings": 256, **TOKENS}


@dataclass(frozen=True)
class Family:
    name: str  # the matrix's row: "llama", "qwen2", ...
    architecture: str  # config.json's `architectures[0]`
    config: Callable[[], Any]  # a transformers config, tiny
    notes: str  # what this family's build keeps, for the docs table


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, intermediate_size=128, num_key_value_heads=1, tie_word_embeddings=True)


def _qwen2() -> Any:
    from transformers import Qwen2Config

    # q/k/v carry biases in every Qwen2 (not a config switch); the head is untied like Qwen2-7B's
    return Qwen2Config(**COMMON, intermediate_size=128, num_key_value_heads=1, tie_word_embeddings=False)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # one sliding-window layer (window 32, shorter than the calibration rows) and one global one
    return Gemma3TextConfig(**COMMON, intermediate_size=128, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                            sliding_window=32, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=True)


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**COMMON, intermediate_size=128, num_key_value_heads=1, original_max_position_embeddings=256,
                      tie_word_embeddings=False)


def _gpt_neox() -> Any:
    from transformers import GPTNeoXConfig

    # Pythia's shape: 4x MLP, a quarter of each head rotary, biases everywhere, untied embed_out
    return GPTNeoXConfig(**COMMON, intermediate_size=256, rotary_pct=0.25, use_parallel_residual=True,
                         attention_bias=True, tie_word_embeddings=False)


def _qwen2_moe() -> Any:
    from transformers import Qwen2MoeConfig

    # 4 routed experts (2 a token) of width 64, a shared expert of width 128 behind its own gate
    return Qwen2MoeConfig(**COMMON, num_key_value_heads=1, intermediate_size=128, moe_intermediate_size=64,
                          shared_expert_intermediate_size=128, num_experts=4, num_experts_per_tok=2,
                          decoder_sparse_step=1, tie_word_embeddings=False)


FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("llama", "LlamaForCausalLM", _llama, "grouped-query attention, tied embeddings"),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2, "q/k/v biases, grouped-query attention, untied `lm_head`"),
    Family("gemma3", "Gemma3ForCausalLM", _gemma3,
           "text only: a sliding-window layer (window 32) and a global one, tied embeddings, (1 + weight) RMSNorms "
           "before and after each sublayer, q/k norms"),
    Family("phi3", "Phi3ForCausalLM", _phi3, "`qkv_proj` and `gate_up_proj` fused in the checkpoint, untied `lm_head`"),
    Family("gpt-neox", "GPTNeoXForCausalLM", _gpt_neox,
           "`query_key_value`, `dense_h_to_4h` / `dense_4h_to_h`, biases on every linear layer, LayerNorms, parallel "
           "residual, a quarter of each head rotary, untied `embed_out`"),
    Family("qwen2-moe", "Qwen2MoeForCausalLM", _qwen2_moe,
           "4 routed experts (top 2) and a gated shared expert per block, routers, q/k/v biases, untied `lm_head`"),
)}


def build_shared_tokenizer(path: Path) -> Path:
    """The one tokenizer every family's model carries (trained once: about a second)."""
    build_tokenizer(path, VOCAB)
    return path


def build_family(name: str, path: Path, tokenizer_dir: Path, *, seed: int = 0) -> Path:
    """A random `name` model in BF16 safetensors with the shared tokenizer and a generation config."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    family = FAMILIES[name]
    path.mkdir(parents=True, exist_ok=True)
    for file in tokenizer_dir.iterdir():
        shutil.copy2(file, path / file.name)
    config = family.config()
    config.dtype = "bfloat16"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    assert type(model).__name__ == family.architecture, (name, type(model).__name__)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig.from_model_config(config).save_pretrained(path)
    return path
