"""What this folder's decoding scripts share: 2 threads, the default config's target (configs/smollm2.yaml), every
`step`-th merge-tuning prompt encoded, and the configured drafter's decoder (plus plain decoding's when asked). Run the
scripts from the repository root."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, '.')
from perf.bench import BenchConfig, VariantSpec, build_decoder, encode_prompt, load_target, resolve  # noqa: E402
from runtime.prompts import load_prompt_file  # noqa: E402


def setup(step: int, plain: bool = False):
    """(target, encoded prompts, configured decoder[, plain decoder])"""
    torch.set_num_threads(2)
    target = load_target(BenchConfig(config=Path('configs/smollm2.yaml'), threads=2))
    prompts = load_prompt_file('demo/smollm2/prompts/merge-tuning.jsonl')[0:44:step]
    enc = [encode_prompt(target.tokenizer, p) for p in prompts]
    dec, _ = build_decoder(target, resolve(VariantSpec.parse('eagle'), target, {}))
    return (target, enc, dec, build_decoder(target, None)[0]) if plain else (target, enc, dec)
