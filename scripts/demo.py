"""End-to-end demo on this machine: checkpoint -> engine directory -> speculative generation -> measurements.

Until the trained demo model lands (the embedded-default issue), the target is a Llama-architecture model with
RANDOM weights (written by transformers' own save_pretrained) and a real byte-level BPE tokenizer trained here on
the standard library's source. Random weights mean acceptance comes only from prompt lookup on the model's own
repetitive output; the pipeline (build, verify, stream, measure) is the real one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

console = Console()


def stdlib_files(limit: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if "test" not in p.name)
    return files[:limit]


def make_checkpoint(out: Path) -> Path:
    """A random-weight Llama checkpoint + a BPE tokenizer trained on stdlib source (deterministic)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2048, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((p.read_text(encoding="utf-8", errors="replace") for p in stdlib_files(60)), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048, bos_token_id=0,
                      eos_token_id=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/demo", help="work directory")
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    out = Path(args.out)

    console.rule("1. checkpoint (random weights, real tokenizer and file formats)")
    ckpt = make_checkpoint(out / "checkpoint").resolve()
    console.print(f"checkpoint: {ckpt}")

    console.rule("2. engine directory (python -m builder build)")
    cfg = out / "demo.yaml"
    cfg.write_text(
        f"model: {{checkpoint: {ckpt}}}\n"
        "draft:\n  method: lookup\n  lookup: {max_ngram: 3, min_ngram: 1, num_draft_tokens: 10, max_depth: 6}\n"
        f"build: {{dtype: float32, max_seq_len: 2048, max_draft_len: 10, output: {(out / 'engine').resolve()}}}\n"
    )
    subprocess.run([sys.executable, "-m", "builder", "build", "--config", str(cfg), "--force"], check=True)

    console.rule("3. speculative generation from the engine, against plain decoding")
    import runtime

    engine = out / "engine"
    plain = runtime.load(engine, draft="none")
    spec = runtime.load(engine)
    prompts = [p.read_text(encoding="utf-8", errors="replace")[:400] for p in stdlib_files(200)[-4:]]
    table = Table("prompt", "plain tok/s", "spec tok/s", "tau", "speedup", "identical")
    for i, prompt in enumerate(prompts):
        a = plain.generate(prompt, max_tokens=args.max_tokens, ignore_eos=True)
        b = spec.generate(prompt, max_tokens=args.max_tokens, ignore_eos=True)
        ra = a.stats.generated_tokens / a.stats.time_total
        rb = b.stats.generated_tokens / b.stats.time_total
        table.add_row(str(i), f"{ra:.1f}", f"{rb:.1f}", f"{b.stats.tau:.2f}", f"{rb / ra:.2f}x",
                      str(a.token_ids == b.token_ids))
        if a.token_ids != b.token_ids:
            console.print("[red]greedy outputs differ: this is a bug[/red]")
            return 1
    console.print(table)

    console.rule("4. streaming")
    t0 = time.perf_counter()
    for delta in spec.stream(prompts[0][:120], max_tokens=48, temperature=0.8, seed=0):
        console.print(delta.text, end="", markup=False, highlight=False)
    console.print(f"\n[dim]streamed in {time.perf_counter() - t0:.2f}s (sampled at T=0.8, lossless)[/dim]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
