"""Self-distillation data for draft heads: the target answers chat prompts, and its own features are cached.

EAGLE and Medusa-2 train their heads on text the target itself produces, so a head learns to predict what the
target will say, not what some corpus says. Two resumable stages, both under one data directory:

    generate   prompts (JSON Lines, perf's prompt format) -> the target's chat answers: the greedy one, and
               `answers - 1` more sampled at `temperature` (more of the target's own text per prompt)
               conversations.jsonl: {"id", "prompt_ids", "response_ids"} (one line per finished answer; answer k > 0
               of prompt P has id "P#k"; a rerun skips the ids already there). Batched transformers `generate`
               (left padding) in the target's dtype.
    features   tokens.npy  # [T] int32   every conversation (prompt + answer) concatenated in file order
               starts.npy  # [C] int64   each conversation's first index into tokens
               hidden.pt   # [T, H]      the target's final-norm hidden state at every position (bfloat16), each
                                         conversation run on its own from its start, as the runtime would
               features-J1-J2-J3.pt  # [T, 3H]  with feature layers (EAGLE-3): the residual streams entering
                                         those layers (`runtime.model`'s feature layers), bfloat16
               Conversations appended since the last run (more prompts, more answers) are the only ones run then:
               the cached rows of the others are kept.

A training window is a range of positions into these arrays, so head training never runs the target.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime import schema
from runtime.errors import ConfigError
from runtime.schema import setting

CONVERSATIONS = "conversations.jsonl"
TOKENS, STARTS, HIDDEN = "tokens.npy", "starts.npy", "hidden.pt"


@dataclass(frozen=True)
class GenerateSettings:
    max_new_tokens: int = setting(256, ge=1)
    batch_size: int = setting(16, ge=1)
    answers: int = setting(1, ge=1)  # per prompt: the greedy answer, then answers - 1 sampled ones
    temperature: float = setting(0.8, gt=0)  # of the sampled answers
    dtype: str = setting("bfloat16", choices=("float32", "bfloat16"))
    threads: int | None = None

    def __post_init__(self) -> None:
        schema.check(self, ConfigError, "generate")


@dataclass(frozen=True)
class DistillData:
    tokens: np.ndarray  # [T] int32
    starts: np.ndarray  # [C] int64
    hidden: torch.Tensor  # [T, H] bfloat16
    features: torch.Tensor | None = None  # [T, F * H] bfloat16: the feature layers' streams (None: none asked)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def _load_hf(target_dir: Path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, dtype))
    model.eval().requires_grad_(False)
    return tok, model


def answer_id(prompt_id: str, k: int) -> str:
    """The conversation id of answer k of a prompt (k = 0: the greedy answer, whose id is the prompt's)."""
    return prompt_id if k == 0 else f"{prompt_id}#{k}"


def prompt_of(conversation_id: str) -> str:
    return conversation_id.split("#", 1)[0]


def _done_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    done = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            done.add(json.loads(line)["id"])
    return done


def generate(target_dir: str | Path, prompts: Sequence[tuple[str, str]], data_dir: str | Path,
             settings: GenerateSettings = GenerateSettings(), quiet: bool = False) -> Path:
    """prompts: (id, user text) pairs. Appends the target's greedy chat answers to data_dir/conversations.jsonl."""
    from tqdm import tqdm

    target_dir, data_dir = Path(target_dir), Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    out = data_dir / CONVERSATIONS
    done = _done_ids(out)
    todo = [(answer_id(i, k), p) for k in range(settings.answers) for i, p in prompts if answer_id(i, k) not in done]
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if not todo:
        return out
    tok, model = _load_hf(target_dir, settings.dtype)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    # Similar lengths batch together (less padding).
    encoded = [(i, tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)) for i, p in todo]
    encoded.sort(key=lambda e: ("#" in e[0], len(e[1])))  # greedy answers first, then similar lengths together
    bar = tqdm(total=len(encoded), desc="generating answers", unit="prompt", disable=quiet)
    with out.open("a", encoding="utf-8") as fh:
        for b in range(0, len(encoded), settings.batch_size):
            batch = encoded[b:b + settings.batch_size]
            width = max(len(ids) for _, ids in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for _, ids in batch])
            attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
            sampled = "#" in batch[0][0]
            if sampled:  # reproducible per batch: seeded by the batch's first conversation id
                torch.manual_seed(int.from_bytes(hashlib.sha256(batch[0][0].encode()).digest()[:8], "little"))
            with torch.no_grad():
                gen = model.generate(input_ids=input_ids, attention_mask=attention, do_sample=sampled,
                                     temperature=settings.temperature if sampled else None, top_k=None, top_p=None,
                                     max_new_tokens=settings.max_new_tokens, pad_token_id=pad, eos_token_id=eos)
            eos_set = set(eos if isinstance(eos, list) else [eos])
            for (pid, ids), row in zip(batch, gen[:, width:].tolist()):
                cut = next((k + 1 for k, t in enumerate(row) if t in eos_set), len(row))
                fh.write(json.dumps({"id": pid, "prompt_ids": list(ids), "response_ids": row[:cut]}) + "\n")
            fh.flush()
            bar.update(len(batch))
    bar.close()
    return out


def conversations(data_dir: str | Path) -> list[dict]:
    """The generated conversations, in file order: {"id", "prompt_ids", "response_ids"} each."""
    path = Path(data_dir) / CONVERSATIONS
    if not path.is_file():
        raise ConfigError(f"{path} does not exist; generate the answers first")
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def features_file(layers: Sequence[int]) -> str:
    """The cache file of the feature layers' streams."""
    return "features-" + "-".join(str(j) for j in layers) + ".pt"


def features(target_dir: str | Path, data_dir: str | Path, convs: Sequence[dict], dtype: str = "bfloat16",
             chunk_tokens: int = 4096, quiet: bool = False, layers: tuple[int, ...] = ()) -> DistillData:
    """Run the target over every conversation (`conversations(data_dir)`, each from its start) and cache tokens +
    hidden states in data_dir, and the streams entering `layers` (ascending, each below the target's layer count)
    when asked."""
    from tqdm import tqdm

    target_dir, data_dir = Path(target_dir), Path(data_dir)
    if not convs:
        raise ConfigError(f"{data_dir / CONVERSATIONS} holds no conversations; run generation first")
    seqs = [c["prompt_ids"] + c["response_ids"] for c in convs]
    starts = np.cumsum([0] + [len(s) for s in seqs[:-1]]).astype(np.int64)
    tokens = np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs])
    paths = [data_dir / n for n in (TOKENS, STARTS, HIDDEN)] + ([data_dir / features_file(layers)] if layers else [])
    done = 0  # conversations whose features are cached (the cache covers a prefix of them)
    old: list[torch.Tensor] = []
    if all(p.is_file() for p in paths):
        cached, cached_starts = np.load(paths[0]), np.load(paths[1])
        n_cached = cached.shape[0]
        if cached.shape == tokens.shape and bool((cached == tokens).all()):
            kept = [torch.load(p, weights_only=True) for p in paths[2:]]
            return DistillData(cached, cached_starts, kept[0], kept[1] if layers else None)
        k = cached_starts.shape[0]
        # Conversations appended since (more prompts or answers): only the new ones run through the target.
        if (0 < k < len(seqs) and int(starts[k]) == n_cached and bool((cached_starts == starts[:k]).all())
                and bool((cached == tokens[:n_cached]).all())):
            old = [torch.load(p, weights_only=True) for p in paths[2:]]
            done = k if all(t.shape[0] == n_cached for t in old) else 0
    _, model = _load_hf(target_dir, dtype)
    h_size, n_layers = model.config.hidden_size, model.config.num_hidden_layers
    if any(not 0 <= j < n_layers for j in layers):
        raise ConfigError(f"feature layers {list(layers)}: expected layers in [0, {n_layers}) of the target (the "
                          f"streams entering them)")
    hidden = torch.empty(tokens.shape[0], h_size, dtype=torch.bfloat16)
    feats = torch.empty(tokens.shape[0], len(layers) * h_size, dtype=torch.bfloat16) if layers else None
    if done:
        hidden[:old[0].shape[0]] = old[0]
        if feats is not None:
            feats[:old[1].shape[0]] = old[1]
    del old
    # Batch conversations of similar length together, padded on the right (causal: padding never reaches a real row).
    order = sorted(range(done, len(seqs)), key=lambda i: len(seqs[i]))
    bar = tqdm(total=int(tokens.shape[0] - starts[done]), desc="target features", unit="tok", disable=quiet)
    i = 0
    while i < len(order):
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max(chunk_tokens, len(seqs[order[j]])):
            j += 1
        group = order[i:j]
        width = max(len(seqs[g]) for g in group)
        ids = torch.tensor([seqs[g] + [0] * (width - len(seqs[g])) for g in group])
        with torch.no_grad():
            out = model.model(input_ids=ids, output_hidden_states=bool(layers))
        h = out.last_hidden_state  # [b, width, H]
        # transformers' hidden_states[j] (j < layers) is the stream entering layer j
        f = torch.cat([out.hidden_states[j] for j in layers], dim=-1) if layers else None  # [b, width, F * H]
        for row, g in enumerate(group):
            n = len(seqs[g])
            hidden[starts[g]:starts[g] + n] = h[row, :n].to(torch.bfloat16)
            if f is not None:
                feats[starts[g]:starts[g] + n] = f[row, :n].to(torch.bfloat16)
            bar.update(n)
        i = j
    bar.close()
    np.save(paths[0], tokens)
    np.save(paths[1], starts)
    torch.save(hidden, paths[2])
    if feats is not None:
        torch.save(feats, paths[3])
    return DistillData(tokens, starts, hidden, feats)


__all__ = ["DistillData", "GenerateSettings", "answer_id", "conversations", "generate", "features", "features_file",
           "prompt_of", "CONVERSATIONS"]
