"""The third-party JSON a checkpoint carries beside its weights, as quantgate reads it: a Hugging
Face config.json, its quantization config (compressed-tensors, GPTQ, AWQ) and AutoGPTQ's
quantize_config.json. Other projects own these shapes: each TypedDict names only the fields
quantgate reads, with the types their writers document (total=False: any may be absent). Nothing
validates them on reading, so every reader still checks a value before trusting it."""

from __future__ import annotations

from typing import TypedDict


class QuantizationArgs(TypedDict, total=False):
    """compressed-tensors QuantizationArgs as JSON: a config group's `weights` or
    `input_activations`, and the arguments a quantize preset hands compressed-tensors."""

    num_bits: int
    type: str  # "int" | "float"
    symmetric: bool
    strategy: str  # "tensor" | "channel" | "group" | "block" | "token"
    group_size: int
    block_structure: list[int]
    dynamic: bool | str  # compressed-tensors also writes "local"
    actorder: str | bool | None
    observer: str
    zp_dtype: str | None


class ConfigGroup(TypedDict, total=False):
    """One compressed-tensors `config_groups` entry: which modules, and their schemes."""

    targets: list[str]
    weights: QuantizationArgs
    input_activations: QuantizationArgs | None
    format: str


class DynamicOverride(TypedDict, total=False):
    """A GPTQModel `dynamic` override: another bit width or group size for matching modules."""

    bits: int
    group_size: int


class QuantizationConfig(TypedDict, total=False):
    """config.json's `quantization_config` (or `compression_config`), or AutoGPTQ's
    quantize_config.json: the fields of compressed-tensors, GPTQ and AWQ quantgate reads."""

    quant_method: str
    # compressed-tensors
    config_groups: dict[str, ConfigGroup]
    ignore: list[str]
    format: str
    # GPTQ (AutoGPTQ, GPTQModel)
    bits: int
    group_size: int
    sym: bool
    dynamic: dict[str, DynamicOverride]
    # AWQ (AutoAWQ)
    w_bit: int
    q_group_size: int
    zero_point: bool
    version: str
    modules_to_not_convert: list[str] | None


class ModelConfig(TypedDict, total=False):
    """A Hugging Face config.json: the dtype, the embeddings' tie, the quantization config and
    the shape of the KV cache (GPT-2 names in `n_layer`, `n_head`; a multimodal model's text
    decoder under `text_config`)."""

    architectures: list[str]
    torch_dtype: str
    dtype: str
    tie_word_embeddings: bool
    quantization_config: QuantizationConfig
    compression_config: QuantizationConfig
    text_config: ModelConfig
    num_hidden_layers: int
    n_layer: int
    num_attention_heads: int
    n_head: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
