"""Prompt files: JSON Lines, one prompt per line (benchmarks, tree tuning, head training all read them here).

    {"id": "code-fib", "source": "spectree project", "prompt": "def fibonacci(n):\\n ..."}
    {"id": "chat-tea", "prompt": "How do I brew green tea?", "chat": true}

`prompt` (non-empty text) is required; `id` (unique within a file) defaults to "line-N" (its line number);
`source` says where the text comes from; `chat: true` marks a user message to send through the model's chat
template (an Instruct model's form) rather than raw text to continue. Blank lines are skipped. The set's name is
the file's stem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    set: str  # the prompt set's name (file stem)
    id: str  # unique within its set
    text: str
    source: str = ""
    chat: bool = False  # a user message for the chat template, not raw text

    def as_input(self) -> str | list[dict[str, Any]]:
        """What a decoder takes: the raw text, or one user message (chat prompts)."""
        return [{"role": "user", "content": self.text}] if self.chat else self.text

    @property
    def key(self) -> str:
        """Unique across sets: "<set>/<id>"."""
        return f"{self.set}/{self.id}"


def load_prompt_file(path: str | Path) -> tuple[Prompt, ...]:
    """Read one JSON Lines prompt file; ConfigError names the file, the line and what was wrong."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise ConfigError(f"prompt file {path} does not exist") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"prompt file {path}: cannot read as UTF-8 text ({exc})") from exc
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not a JSON object ({exc.msg}); expected "
                                  '{"id": "...", "prompt": "..."} on each line') from exc
        if not isinstance(record, dict):
            raise ConfigError(f"{where}: got a JSON {type(record).__name__}, expected an object with id and prompt")
        unknown = sorted(set(record) - {"id", "prompt", "source", "chat"})
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; expected id, prompt and optionally source, "
                                  "chat")
        pid, text, source = record.get("id", f"line-{lineno}"), record.get("prompt"), record.get("source", "")
        if not isinstance(pid, str) or not pid or "/" in pid:
            raise ConfigError(f"{where}: id: got {pid!r}, expected a non-empty string without '/'")
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{where}: prompt: got {text!r}, expected non-empty text")
        if not isinstance(source, str):
            raise ConfigError(f"{where}: source: got {source!r}, expected a string")
        chat = record.get("chat", False)
        if not isinstance(chat, bool):
            raise ConfigError(f"{where}: chat: got {chat!r}, expected true or false")
        if pid in seen:
            raise ConfigError(f"{where}: id {pid!r} repeats the id on line {seen[pid]}")
        seen[pid] = lineno
        prompts.append(Prompt(set=path.stem, id=pid, text=text, source=source, chat=chat))
    if not prompts:
        raise ConfigError(f"prompt file {path} holds no prompts")
    return tuple(prompts)




__all__ = ["Prompt", "load_prompt_file"]
