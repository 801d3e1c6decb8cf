"""Text corpora for training: file lists, the fixed held-out split, a byte-level BPE, token caches, batches.

The default corpus is the standard library's own source (`sysconfig`'s stdlib directory), present on every Python
install; folders named test / tests / idle_test and installed packages are excluded. The split is per FILE and
fixed: a file is held out when the first 8 hex digits of sha256(relative posix path) / 2^32 < held_out, so it
does not depend on file order, machine or run.

Tokens are stored as one flat int32 array per split, each file as <bos> text <eos>, cached in a work directory
under a fingerprint of (file list, sizes, tokenizer) so an unchanged corpus is tokenised once.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from builder.training.config import CorpusSection
from runtime.errors import ConfigError

SPECIAL_TOKENS = ("<s>", "</s>")  # ids 0 and 1: trained tokenizers list them first


@dataclass(frozen=True)
class CorpusFile:
    rel: str  # posix path relative to the corpus root (what the split hashes)
    path: Path
    size: int


@dataclass(frozen=True)
class CorpusSplit:
    root: Path
    train: tuple[CorpusFile, ...]
    held_out: tuple[CorpusFile, ...]

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        for name, files in (("train", self.train), ("held_out", self.held_out)):
            h.update(name.encode())
            for f in files:
                h.update(f"{f.rel}\0{f.size}\n".encode())
        return h.hexdigest()


def corpus_root(section: CorpusSection) -> Path:
    root = Path(sysconfig.get_paths()["stdlib"]) if section.source == "stdlib" else section.path
    assert root is not None
    if not root.is_dir():
        raise ConfigError(f"corpus root {root} (corpus.source {section.source!r}) is not a directory")
    return root


def is_held_out(rel: str, fraction: float) -> bool:
    """The fixed file-level split: sha256 of the relative path, first 32 bits as a fraction of 2^32."""
    return int(hashlib.sha256(rel.encode("utf-8")).hexdigest()[:8], 16) / 2**32 < fraction


def split_corpus(section: CorpusSection) -> CorpusSplit:
    root = corpus_root(section)
    excluded = set(section.exclude_dirs)
    train, held = [], []
    for path in sorted(root.glob(section.pattern)):
        rel = path.relative_to(root).as_posix()
        if not path.is_file() or excluded.intersection(path.relative_to(root).parts[:-1]):
            continue
        size = path.stat().st_size
        if size == 0 or size > section.max_file_bytes:
            continue
        (held if is_held_out(rel, section.held_out) else train).append(CorpusFile(rel, path, size))
    if not train or not held:
        raise ConfigError(
            f"corpus {root} (pattern {section.pattern!r}) gave {len(train)} training and {len(held)} held-out files; "
            "need at least one of each"
        )
    return CorpusSplit(root, tuple(train), tuple(held))


def read_text(f: CorpusFile) -> str:
    return f.path.read_bytes().decode("utf-8", errors="replace")


def byte_level_bpe(vocab_size: int, special_tokens: Sequence[str]):
    """An untrained byte-level BPE tokenizer (GPT-2 pre-tokenisation and decoder, no unknown tokens) and its
    trainer; `special_tokens` get the first ids, in order. Returns (tokenizers.Tokenizer, BpeTrainer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tok, trainer


def train_tokenizer(files: Sequence[CorpusFile], vocab_size: int, out_dir: Path, max_length: int) -> Path:
    """Byte-level BPE (GPT-2 pre-tokenisation, no unknown tokens) on `files`; writes tokenizer.json and
    tokenizer_config.json (bos <s> = 0, eos </s> = 1). Deterministic for a given file list."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok, trainer = byte_level_bpe(vocab_size, SPECIAL_TOKENS)
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer, length=len(files))
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[1],
        "add_bos_token": True,
        "model_max_length": max_length,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    return out_dir / "tokenizer.json"


def _tokenize(files: Sequence[CorpusFile], tokenizer_dir: Path) -> np.ndarray:
    """<bos> text <eos> per file, concatenated. # [num_tokens] int32"""
    from tokenizers import Tokenizer as HFTokenizer

    from runtime.tokenizer import Tokenizer

    special = Tokenizer.from_dir(tokenizer_dir)  # bos / eos exactly as the runtime reads them
    tok = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    bos = [] if special.bos_token_id is None else [special.bos_token_id]
    eos = list(special.eos_token_ids[:1])
    parts = []
    for start in range(0, len(files), 64):
        chunk = files[start:start + 64]
        for enc in tok.encode_batch([read_text(f) for f in chunk], add_special_tokens=False):
            parts.append(np.asarray(bos + enc.ids + eos, dtype=np.int32))
    return np.concatenate(parts)


@dataclass(frozen=True)
class TokenData:
    train: np.ndarray  # [num_train_tokens] int32
    held_out: np.ndarray  # [num_held_out_tokens] int32
    vocab_size: int


def load_tokens(split: CorpusSplit, tokenizer_dir: Path, cache_dir: Path) -> TokenData:
    """Token arrays for both splits, from cache_dir when its fingerprint matches, else tokenised and cached."""
    tok_file = tokenizer_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise ConfigError(f"no tokenizer.json in {tokenizer_dir}")
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_file(str(tok_file)).get_vocab_size(with_added_tokens=True)
    key = hashlib.sha256((split.fingerprint() + hashlib.sha256(tok_file.read_bytes()).hexdigest()).encode())
    key_hex = key.hexdigest()[:16]
    cache_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: cache_dir / f"tokens-{key_hex}-{name}.npy" for name in ("train", "held_out")}
    if not all(p.is_file() for p in paths.values()):
        for name, files in (("train", split.train), ("held_out", split.held_out)):
            arr = _tokenize(files, tokenizer_dir)
            tmp = paths[name].with_suffix(".tmp.npy")
            np.save(tmp, arr)
            tmp.replace(paths[name])
    return TokenData(np.load(paths["train"]), np.load(paths["held_out"]), vocab)


def check_windows(tokens: np.ndarray, seq_len: int, what: str) -> None:
    if tokens.shape[0] < seq_len + 2:
        raise ConfigError(f"{what} has {tokens.shape[0]} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}")


def random_windows(tokens: np.ndarray, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` windows of `length` tokens at uniform random offsets. # [batch, length] int64"""
    starts = torch.randint(0, tokens.shape[0] - length + 1, (batch,), generator=gen).tolist()
    return torch.from_numpy(np.stack([tokens[s:s + length] for s in starts]).astype(np.int64))


def fixed_windows(tokens: np.ndarray, count: int, length: int) -> Iterator[torch.Tensor]:
    """`count` evenly spaced windows (the same every evaluation), one at a time. # each [1, length] int64"""
    span = tokens.shape[0] - length
    for i in range(count):
        s = span * i // max(count - 1, 1)
        yield torch.from_numpy(tokens[s:s + length].astype(np.int64))[None]




def held_out_prompts(split: CorpusSplit, part: str, max_chars: int = 320) -> list[str]:
    """Prompts cut from the held-out files: a `def` / `class` line and what follows it, up to max_chars (whole
    lines). Two per file, at about 1/3 and 2/3 of it; part "calibration" takes the first of each file, "evaluation"
    the second, so tuning and measuring never share a prompt."""
    if part not in ("calibration", "evaluation"):
        raise ConfigError(f"part must be 'calibration' or 'evaluation', got {part!r}")
    prompts = []
    for f in split.held_out:
        lines = read_text(f).splitlines(keepends=True)
        for k, frac in enumerate((1 / 3, 2 / 3)):
            if (k == 0) != (part == "calibration"):
                continue
            start = next((i for i in range(int(len(lines) * frac), len(lines))
                          if lines[i].lstrip().startswith(("def ", "class "))), None)
            if start is None:
                continue
            text = ""
            for line in lines[start:]:
                if text and len(text) + len(line) > max_chars:
                    break
                text += line
            if text.strip():
                prompts.append(text)
    return prompts


__all__ = [
    "SPECIAL_TOKENS",
    "CorpusFile",
    "CorpusSplit",
    "TokenData",
    "byte_level_bpe",
    "check_windows",
    "corpus_root",
    "fixed_windows",
    "held_out_prompts",
    "is_held_out",
    "load_tokens",
    "random_windows",
    "read_text",
    "split_corpus",
    "train_tokenizer",
]
