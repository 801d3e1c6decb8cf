"""`python -m builder train-target --config CFG`: train a small Llama-architecture target from scratch.

Steps (each resumable; re-running the command continues where it stopped):
  1. split the corpus per file (fixed held-out set), train a byte-level BPE on the training split only;
  2. tokenise both splits once (cached in target.work_dir);
  3. train `transformers`' LlamaForCausalLM (the reference Llama implementation) with AdamW, warm-up + cosine,
     until max_steps or max_minutes; held-out loss every eval_every steps; resumable state every
     checkpoint_every steps (model, optimizer, batch RNG, step, elapsed time);
  4. write a Hugging Face checkpoint (save_pretrained, safetensors, save_dtype) plus the tokenizer files and the
     training log (training_log.jsonl, training_summary.json) into target.output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from builder.config import BuildConfigError
from builder.training.config import TargetSection, TrainConfig
from builder.training.corpus import (
    SPECIAL_TOKENS,
    check_windows,
    fixed_windows,
    load_tokens,
    split_corpus,
    train_tokenizer,
)
from builder.training.loop import STATE_SUFFIX, optimise
from runtime.files import shown_path

STATE_FILE = f"state{STATE_SUFFIX}"
LOG_FILE = "training_log.jsonl"
SUMMARY_FILE = "training_summary.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class TargetResult:
    output: Path
    steps: int
    elapsed_s: float
    train_tokens: int  # tokens seen in training
    held_out_loss: float  # mean next-token cross-entropy (nats) on the fixed held-out windows (eval_batches)
    num_parameters: int
    held_out_loss_full: float  # the same over windows tiling the whole held-out split (the number to report)
    held_out_windows_full: int


def llama_config(t: TargetSection, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        rope_theta=t.rope_theta,
        rms_norm_eps=t.rms_norm_eps,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        attention_bias=False,
    )


def _fingerprint(t: TargetSection, corpus_fp: str) -> str:
    """What a resumable state must agree with: the model shape, the optimisation settings and the corpus."""
    d = dataclasses.asdict(t)
    for k in ("output", "work_dir"):
        d.pop(k)
    for k in ("max_steps", "max_minutes", "threads"):  # extending a run's budget is allowed
        d["train"].pop(k)
    return hashlib.sha256(json.dumps([d, corpus_fp], sort_keys=True, default=str).encode()).hexdigest()[:16]


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, tokens, count: int, seq_len: int) -> float:
    """Mean next-token cross-entropy over `count` fixed windows of the held-out split (nats/token)."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for w in fixed_windows(tokens, count, seq_len + 1):
        logits = model(input_ids=w[:, :-1]).logits  # [1, seq_len, V]
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum"))
        n += w.shape[1] - 1
    model.train(was_training)
    return total / n


def train_target(config: TrainConfig, fresh: bool = False, quiet: bool = False) -> TargetResult:
    if config.target is None:
        raise BuildConfigError(f"{config.source}: target: missing; train-target needs a target section")
    t, opt = config.target, config.target.train
    from transformers import LlamaForCausalLM

    if opt.threads is not None:
        torch.set_num_threads(opt.threads)
    work = t.work_dir
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)

    split = split_corpus(config.corpus)
    tok_dir = work / "tokenizer"
    if not all((tok_dir / f).is_file() for f in TOKENIZER_FILES):
        train_tokenizer(split.train, t.vocab_size, tok_dir, t.max_position_embeddings)
    data = load_tokens(split, tok_dir, work)
    check_windows(data.train, opt.seq_len, "the training split")
    check_windows(data.held_out, opt.seq_len, "the held-out split")

    fingerprint = _fingerprint(t, split.fingerprint())
    torch.manual_seed(opt.seed)
    model = LlamaForCausalLM(llama_config(t, data.vocab_size))
    tokens_per_step = opt.batch_size * opt.seq_len  # every window predicts seq_len tokens

    def step_loss(batch: torch.Tensor, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        logits = model(input_ids=batch[:, :-1]).logits  # batch [B, seq_len + 1] -> logits [B, seq_len, V]
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()), {}

    def evaluate(step: int) -> dict[str, float]:
        return {"held_out_loss": held_out_loss(model, data.held_out, opt.eval_batches, opt.seq_len),
                "tokens": step * tokens_per_step}

    start = {"train_tokens_available": int(data.train.shape[0]), "held_out_tokens": int(data.held_out.shape[0]),
             "train_files": len(split.train), "held_out_files": len(split.held_out)}
    step, elapsed, _, final = optimise(model, step_loss, evaluate, opt, data.train, opt.seq_len + 1,
                                       work / STATE_FILE, fingerprint, work / LOG_FILE, "target", quiet, start)
    n_params = sum(p.numel() for p in model.parameters())
    # The periodic evals use a few windows (cheap, noisy); the final number scores the whole held-out split once.
    full_windows = max(1, data.held_out.shape[0] // (opt.seq_len + 1))
    full = held_out_loss(model, data.held_out, full_windows, opt.seq_len)

    _write_checkpoint(model, t, tok_dir, work)
    result = TargetResult(t.output, step, elapsed, step * tokens_per_step, final["held_out_loss"], n_params, full,
                          full_windows)
    summary = {**dataclasses.asdict(result), "output": shown_path(t.output), "held_out_files": len(split.held_out),
               "train_files": len(split.train), "corpus_fingerprint": split.fingerprint(),
               "special_tokens": list(SPECIAL_TOKENS), "torch": torch.__version__}
    (t.output / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return result


def _write_checkpoint(model, t: TargetSection, tok_dir: Path, work: Path) -> None:
    """save_pretrained into a temporary sibling, then swap it into place."""
    out = t.output
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    dtype = getattr(torch, t.save_dtype)
    model.to(dtype).save_pretrained(tmp, safe_serialization=True)
    model.to(torch.float32)
    for name in TOKENIZER_FILES:
        shutil.copy2(tok_dir / name, tmp / name)
    shutil.copy2(work / LOG_FILE, tmp / LOG_FILE)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)


__all__ = ["TargetResult", "held_out_loss", "llama_config", "train_target"]
