"""Tiny random Llama-family checkpoints in the real Hugging Face on-disk format, for tests.

`make_checkpoint(dir, variant)` builds a model with `transformers` itself and writes it with `save_pretrained`
(config.json, generation_config.json, model.safetensors or a sharded index), next to a real byte-level BPE
`tokenizer.json` trained with the `tokenizers` library, plus tokenizer_config.json. transformers is imported
lazily so importing this module stays cheap.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

VARIANTS = ("llama2", "llama3", "mistral", "qwen2")

# Special tokens come first, so their ids are fixed: <s>=0, </s>=1, <|eot_id|>=2.
SPECIAL_TOKENS = ("<s>", "</s>", "<|eot_id|>")
BOS_ID, EOS_ID, EOT_ID = 0, 1, 2
TOKENIZER_VOCAB = 420

# Training text: mostly English, with accents, CJK and emoji so that some multibyte characters stay split
# across several byte tokens (what the incremental detokenizer must handle).
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away into the forest.
Speculative decoding drafts several tokens and the target model verifies them in one forward pass.
A tree of candidates lets the verifier accept the longest matching branch, token by token.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159
Café, naïve, résumé, über, jalapeño, smörgåsbord, façade.
日本語のテキストも少し含めます。中文文本也包括在内。
Emoji: 🙂 🚀 🌲 ✨ — and dashes – plus “quotes”.
Once upon a time there was a small model that wanted to run fast. It learned to guess the next words
of its larger sibling, and the sibling only had to check the guesses. Most guesses were right, so the
pair finished the story in half the time.
"""


@functools.lru_cache(maxsize=None)
def tokenizer_json() -> str:
    """A deterministic byte-level BPE tokenizer (tokenizer.json text), trained once per process."""
    from builder.training.corpus import byte_level_bpe

    tok, trainer = byte_level_bpe(TOKENIZER_VOCAB, SPECIAL_TOKENS)
    lines = CORPUS.splitlines(keepends=True)
    tok.train_from_iterator(lines * 3, trainer=trainer)
    return tok.to_str()


def vocab_size() -> int:
    """Vocabulary size of the tiny tokenizer; every tiny model uses exactly this many embeddings."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json()).get_vocab_size()


def _config(variant: str, tie: bool, dtype: str, overrides: dict[str, Any]):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        dtype=dtype,
    )
    if variant == "llama2":
        kw = dict(common, max_position_embeddings=512, rope_theta=10000.0)
        kw.update(overrides)
        return LlamaConfig(**kw)
    if variant == "llama3":
        # original_max_position_embeddings 64: with head_dim 16 and theta 5e5 the wavelengths span ~6 to ~1e6
        # positions, so some frequencies are untouched, one is smoothed, the rest divided by `factor`.
        kw = dict(
            common,
            max_position_embeddings=1024,
            eos_token_id=[EOS_ID, EOT_ID],
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        kw.update(overrides)
        return LlamaConfig(**kw)
    if variant == "mistral":
        # Explicit head_dim (32) != hidden_size / heads (16), as in Mistral-Nemo; sliding_window caps the context.
        kw = dict(common, head_dim=32, max_position_embeddings=1024, sliding_window=256, rope_theta=10000.0)
        kw.update(overrides)
        return MistralConfig(**kw)
    if variant == "qwen2":
        kw = dict(common, max_position_embeddings=512, rope_theta=1000000.0, use_sliding_window=False)
        kw.update(overrides)
        return Qwen2Config(**kw)
    raise ValueError(f"unknown tiny variant {variant!r}; expected one of {VARIANTS}")


def _randomize(model, seed: int) -> None:
    """Weights larger than transformers' init (std 0.02) so logits are far from uniform; norms != 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * noise
            elif name.endswith(".bias"):
                value = 0.1 * noise
            else:
                value = 0.15 * noise
            p.copy_(value.to(p.dtype))


def make_checkpoint(
    dir: str | Path,
    variant: str,
    dtype: str = "float32",
    tie: bool = False,
    sharded: bool = False,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random `variant` checkpoint (+ tokenizer) into `dir` and return it as a Path.

    dtype: "float32" | "bfloat16" | "float16" (weights and config dtype). tie: tie_word_embeddings.
    sharded: several safetensors shards plus model.safetensors.index.json. Config overrides, given as the
    `overrides` dict and/or keyword arguments (e.g. rope_scaling={...}, max_position_embeddings=24), go to
    the transformers config constructor.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    config = _config(variant, tie, dtype, {**(overrides or {}), **config_overrides})
    torch.manual_seed(seed)  # transformers' own init runs first; _randomize then overwrites every parameter
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model = model.to(getattr(torch, dtype))
    # The float32 models are ~400 KB: 150 KB shards give three or four files.
    model.save_pretrained(out, max_shard_size="150KB" if sharded else "5GB")

    (out / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "add_bos_token": True,
        "model_max_length": config.max_position_embeddings,
    }
    if variant == "qwen2":  # Qwen2 has no BOS token.
        tok_cfg["bos_token"] = None
        tok_cfg["add_bos_token"] = False
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    return out
