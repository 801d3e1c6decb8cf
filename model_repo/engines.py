"""What the served models read from the engine directory (or Hugging Face checkpoint directory) they serve:
its context and vocabulary (`engine_facts`, for model_repo.render), its checksums (`verify_engine`) and its
tokenizer (`load_tokenizer`). runtime.engine is imported when called (it imports torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runtime.errors import ConfigError


def engine_facts(path: str) -> tuple[int, int, bool]:
    """(max_context, vocab_size, has_tokenizer) of an engine directory or HF checkpoint directory."""
    from runtime.config import ModelConfig
    from runtime.engine import is_engine_dir, open_engine

    if is_engine_dir(path):
        engine = open_engine(path)
        config = engine.model_config()
        return config.max_context, config.vocab_size, engine.has("tokenizer.json")
    config = ModelConfig.from_hf(path)
    return config.max_context, config.vocab_size, (Path(path) / "tokenizer.json").is_file()


def verify_engine(path: str) -> None:
    """Check every file of an engine directory against the size and sha256 engine.json records
    (EngineChecksumError names the file); a Hugging Face checkpoint directory has no checksums to check."""
    from runtime.engine import is_engine_dir, open_engine

    if not is_engine_dir(path):
        return
    engine = open_engine(path)
    for relpath in sorted(engine.manifest["files"]):
        engine.path(relpath)


def load_tokenizer(path: str) -> Any:
    """The tokenizer `runtime.load(path)` would use (checksum-verified for engine directories)."""
    from runtime.engine import is_engine_dir, open_engine
    from runtime.tokenizer import Tokenizer

    if is_engine_dir(path):
        tok = open_engine(path).tokenizer()
        if tok is None:
            raise ConfigError(f"engine directory {path} has no tokenizer.json; text prompts need one")
        return tok
    return Tokenizer.from_dir(path)


__all__ = ["engine_facts", "load_tokenizer", "verify_engine"]
