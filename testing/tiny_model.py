"""A tiny random Qwen2 model built offline: transformers config, random weights in safetensors
and a byte-level BPE tokenizer trained with `tokenizers` on Python's own standard library.

Its pre-tokenizer is Qwen2's, so llama.cpp's "qwen2" pre-tokenizer splits text the same way.
Dimensions are multiples of 32 (llama-quantize's Q8_0 / Q4_0 blocks) and the head size is 64
(a size vLLM's CPU attention takes).
"""

from __future__ import annotations

import os
from pathlib import Path

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    stdlib = Path(os.__file__).parent
    lines = []
    for path in sorted(stdlib.glob("*.py"))[:60]:
        text = path.read_text(encoding="utf-8", errors="ignore")
        lines += [line for line in text.splitlines() if line.isascii() and line.strip()]
    return lines


def build_tokenizer(out: Path, vocab_size: int = 2048):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer)
    tokenizer.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=SPECIAL[0], pad_token=SPECIAL[0]
    )
    fast.save_pretrained(str(out))
    return fast


def build_tiny_qwen2(out: Path, hidden_size: int = 128, layers: int = 2) -> Path:
    """The default is the tests' model; a wider and deeper one (a bench's) makes prefill cost
    something on a CPU: about 2 x its parameters in FLOPs a prompt token."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    eos = tokenizer.convert_tokens_to_ids(SPECIAL[0])
    assert hidden_size % 64 == 0, "the head size is 64"
    heads = hidden_size // 64
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=eos,
        eos_token_id=eos,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    return out
