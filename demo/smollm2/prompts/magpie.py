"""The self-written part of the head-training prompts (ids `magpie-NNNN` in train.jsonl): user turns the target itself
wrote (Magpie, Xu et al. 2024: an instruct model given its chat template up to the start of a user turn writes a
plausible user request).

The fresh-subject fine-tune showed that breadth of subject is what generalises, and hand-written subject lists run
out. Sampled at temperature 1, the target asks about anything users ask about (recipes, contracts, code, travel,
grief, homework), in their phrasing, typos included, and the head then learns its answers to them: all of it text
the target itself produces, as EAGLE's self-distillation wants. A request is kept when the target ended its turn
(not cut off), it is 24-600 characters long, it is not a repeat (case-insensitive) of itself or of another training
prompt, it is not an evaluation prompt, and it touches no held-out subject (`fresh.touches_held_out`: the benchmark's,
calibration and head-selection subjects; checked by tests/test_prompt_sets.py), so the head-selection prompts stay a
fair test of new subjects.

    python demo/smollm2/prompts/magpie.py [--count 1600]   # rewrites the magpie-* lines of train.jsonl

Sampling runs transformers' batched `generate` in bfloat16 (seeded per batch); another CPU may round otherwise and
write other requests, so the committed lines are the record, not this script's output elsewhere.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import broad  # the sibling scripts (its directory is sys.path[0] when run by path; the tests add it)
import fresh

HERE = Path(__file__).resolve().parent
SEED = 20261206
SOURCE = "written by the target (SmolLM2-135M-Instruct, Magpie sampling at T = 1: demo/smollm2/prompts/magpie.py)"
PREFIX = "magpie-"
MODEL = HERE.parents[2] / "models" / "smollm2-135m-instruct"
MIN_CHARS, MAX_CHARS = 24, 600
SENTINEL = "\x00USER\x00"


def taken() -> set[str]:
    """The lower-cased prompts no request may repeat: the earlier parts of train.jsonl and the held-out prompts."""
    return {p.lower() for p in [*broad.earlier_prompts(PREFIX), *broad.held_out_prompts()]}


def keep(text: str, seen: set[str]) -> bool:
    """Whether a sampled request joins the set (`seen`: the lower-cased prompts taken so far, earlier parts too)."""
    return MIN_CHARS <= len(text) <= MAX_CHARS and text.lower() not in seen and not fresh.touches_held_out(text)


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text up to where a user's request starts (its default system turn included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False)
    return text[: text.index(SENTINEL)]


def sample_requests(count: int, batch: int, max_new_tokens: int) -> list[str]:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16).eval()
    ids = tokenizer(user_turn_prefix(tokenizer), return_tensors="pt", add_special_tokens=False).input_ids  # [1, P]
    end_ids = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id} - {None, tokenizer.unk_token_id}
    seen = taken()
    picked: list[str] = []
    drawn = 0
    with tqdm(total=count, desc="requests kept", unit="req") as bar:
        while len(picked) < count:
            torch.manual_seed(SEED + drawn)
            with torch.no_grad():
                out = model.generate(ids.repeat(batch, 1), attention_mask=torch.ones_like(ids).repeat(batch, 1),
                                     do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=max_new_tokens, eos_token_id=sorted(end_ids),
                                     pad_token_id=tokenizer.eos_token_id)
            drawn += batch
            for row in out[:, ids.shape[1]:].tolist():
                ended = next((i for i, t in enumerate(row) if t in end_ids), None)
                if ended is None:  # cut off at max_new_tokens: not a whole request
                    continue
                text = tokenizer.decode(row[:ended], skip_special_tokens=True).strip()
                if len(picked) < count and keep(text, seen):
                    seen.add(text.lower())
                    picked.append(text)
                    bar.update(1)
            bar.set_postfix(drawn=drawn)
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1600, help="requests to keep")
    parser.add_argument("--batch", type=int, default=64, help="requests sampled per generate call")
    parser.add_argument("--max-new-tokens", type=int, default=112, help="longest request sampled (longer: dropped)")
    args = parser.parse_args()
    t0 = time.time()
    prompts = sample_requests(args.count, args.batch, args.max_new_tokens)
    total = broad.write_part(PREFIX, SOURCE, prompts)
    print(f"{HERE / 'train.jsonl'}: {total} prompts ({len(prompts)} magpie) in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
