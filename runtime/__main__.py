"""python -m runtime generate --model DIR (--prompt TEXT [--chat [--system TEXT]] | --prompt-ids 1,2,3) [options]

Defaults come from `runtime.api.LoadConfig` and `runtime.sampling.SamplingParams` (one source of truth).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from runtime.api import LoadConfig, build
from runtime.config import DTYPE_CHOICES, TARGET_QUANTIZATIONS
from runtime.draft_spec import QUANTIZATIONS, kind_names, option_value
from runtime.errors import SpectreeError
from runtime.request_fields import SamplingParams, add_flags
from runtime.tokenizer import single_turn


SAMPLING_FLAGS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos")  # request contract fields


def _default(cls, name: str):
    return cls.__dataclass_fields__[name].default


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from e


def _options(pairs: Sequence[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--draft-option must look like KEY=VALUE, got {pair!r}")
        out[key] = option_value(value)
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m runtime", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from a prompt with speculative decoding")
    g.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated")
    g.add_argument("--chat", action="store_true",
                   help="send --prompt as one user message through the model's chat template")
    g.add_argument("--system", help="with --chat: a system message before the user message")
    add_flags(g, SAMPLING_FLAGS)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--draft", choices=kind_names(), default=_default(LoadConfig, "draft"),
                   help="drafter (default: an engine's own, else inferred from --draft-model, else none)")
    g.add_argument("--draft-model", default=_default(LoadConfig, "draft_model"), help="Medusa/EAGLE head directory")
    g.add_argument("--tree", default=_default(LoadConfig, "tree"),
                   help="tree preset (mc_sim_7b_63, chain-K) or JSON list of choice paths")
    g.add_argument("--dtype", choices=DTYPE_CHOICES, default=_default(LoadConfig, "dtype"))
    g.add_argument("--max-draft-len", type=int, default=_default(LoadConfig, "max_draft_len"))
    g.add_argument("--device", default=_default(LoadConfig, "device"), help="torch device: cpu, cuda, cuda:1, ...")
    g.add_argument("--draft-quantization", choices=QUANTIZATIONS, default=_default(LoadConfig, "draft_quantization"),
                   help="the EAGLE head's weights as drafting reads them (int8 / int4: weight-only, CPU)")
    g.add_argument("--target-quantization", choices=TARGET_QUANTIZATIONS,
                   default=_default(LoadConfig, "target_quantization"),
                   help="the target's weights as the forward reads them (q8 / q4: GGUF Q8_0 / Q4_1 blocks, CPU); "
                        "decoding is lossless against that quantised target")
    g.add_argument("--draft-option", action="append", default=[], metavar="KEY=VALUE",
                   help="drafter option, e.g. total_tokens=60 (eagle) or max_ngram=4 (lookup); repeatable")
    g.add_argument("--json", action="store_true", help="print one JSON object: token_ids, text, stats")
    return p


def _prompt(args: argparse.Namespace) -> str | list[int] | list[dict[str, str]]:
    if not args.chat:
        return args.prompt if args.prompt is not None else args.prompt_ids
    return single_turn(args.prompt, args.system)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.chat and args.prompt is None:
        p.error("--chat needs --prompt (the user message), not --prompt-ids")
    if args.system is not None and not args.chat:
        p.error("--system needs --chat (it is a chat message)")
    try:
        params = SamplingParams(stop=tuple(args.stop), **{name: getattr(args, name) for name in SAMPLING_FLAGS})
        decoder = build(
            LoadConfig(
                model=args.model, draft=args.draft, draft_model=args.draft_model, tree=args.tree, dtype=args.dtype,
                max_draft_len=args.max_draft_len, device=args.device, draft_options=_options(args.draft_option),
                draft_quantization=args.draft_quantization, target_quantization=args.target_quantization,
            )
        )
        prompt = _prompt(args)
        if args.json:
            result = decoder.generate(prompt, params)
            out = {"token_ids": list(result.token_ids), "text": result.text, "finish_reason": result.finish_reason,
                   "stats": result.stats.to_dict()}
            sys.stdout.write(json.dumps(out) + "\n")
            return 0
        for delta in decoder.stream(prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            if delta.stats is not None:
                s = delta.stats
                sys.stderr.write(
                    f"\n[{delta.finish_reason}] "
                    f"{s.generated_tokens} tokens, {s.steps} steps, tau {s.tau:.2f}, "
                    f"{s.generated_tokens / max(s.time_total, 1e-9):.1f} tok/s, drafter {s.drafter}, "
                    f"verification {s.verification}\n"
                )
        return 0
    except (SpectreeError, argparse.ArgumentTypeError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
