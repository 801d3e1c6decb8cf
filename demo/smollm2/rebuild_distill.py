"""Rebuild the heads' self-distillation answers from the EAGLE head's datastore instead of generating them again.

`python -m builder train-heads` keeps the target's answers in heads.work_dir (out/smollm2-train/distill/
conversations.jsonl), which is not committed; answering every training prompt again costs hours on 2 cores. The
committed datastore (eagle/datastore.npz) holds the same answers, token for token, in the order train-heads wrote
them (held-out prompts left out). That order is generate()'s, run by run: each run answers what is missing, the
greedy answers first, then the sampled ones, each group sorted by prompt length (ties in (answer, file) order). The
runs behind the committed head, in order:

    1. train-*            greedy                 (the Medusa run: answers 1)
    2. train-*            first sampled answer   (the first EAGLE run: answers 2)
    3. broad-*            greedy + first sampled (broad.py's prompts appended)
    4. wide-*             greedy + first sampled (wide.py's prompts appended)
    5. train/broad/wide   second sampled answer  (answers 3)
    6. train/broad/wide   third sampled answer   (answers 4: the datastore only)
    7. prose-*            greedy + first sampled (prose.py's prompts appended; train-prose.yaml, whose datastore
                                                  the averaged heads of 2026-12-03 / 12-05 carried)
    8. fresh-*            greedy + first sampled (fresh.py's prompts; train-fresh.yaml)
    9. magpie-*           greedy                 (magpie.py's prompts; train-magpie.yaml: the committed datastore
                                                  since session 33 holds runs 1-9)

The longest prefix of these runs whose answer count is the datastore's is taken; the greedy answers are then
checked against the target (teacher-forced argmax over a sample of them: a misplaced answer would agree with the
target's argmax on a small share of its tokens, these agree on >= 0.95). Writes conversations.jsonl of the
training answers into the work directory (refusing to overwrite one); train-heads then generates only what is
still missing there (the held-out prompts' answers).

    python demo/smollm2/rebuild_distill.py [--config demo/smollm2/train-prose.yaml] [--datastore FILE] [--check 16]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from builder.training.config import load_train_config
from builder.training.corpus import is_held_out
from builder.training.distill import CONVERSATIONS, answer_id, prompt_of
from runtime.drafters.datastore import DATASTORE_FILE, SEPARATOR
from runtime.prompts import load_prompt_file

HERE = Path(__file__).resolve().parent

# (prompt-id prefixes, answer indices) of each generate() run, in order (see above)
RUNS = [
    (("train-",), (0,)),
    (("train-",), (1,)),
    (("broad-",), (0, 1)),
    (("wide-",), (0, 1)),
    (("train-", "broad-", "wide-"), (2,)),
    (("train-", "broad-", "wide-"), (3,)),
    (("prose-",), (0, 1)),
    (("fresh-",), (0, 1)),
    (("magpie-",), (0,)),
]
MIN_AGREEMENT = 0.95


def run_order(prefixes: tuple[str, ...], ks: tuple[int, ...], ids: list[str], encoded: dict[str, list[int]]) -> list[str]:
    """The answer ids one generate() run wrote, in its order."""
    todo = [answer_id(i, k) for k in ks for i in ids if i.startswith(prefixes)]
    return sorted(todo, key=lambda a: ("#" in a, len(encoded[prompt_of(a)])))


def stored_answers(path: Path) -> list[list[int]]:
    with np.load(path, allow_pickle=False) as data:
        tokens = data["tokens"]
    cuts = np.flatnonzero(tokens == SEPARATOR).tolist() + [len(tokens)]
    return [tokens[a + 1:b].tolist() for a, b in zip(cuts[:-1], cuts[1:])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(HERE / "train-prose.yaml"), help="the training YAML")
    parser.add_argument("--datastore", default=str(HERE / "eagle" / DATASTORE_FILE), help="the datastore to read")
    parser.add_argument("--check", type=int, default=16, help="greedy answers checked against the target")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_train_config(args.config)
    c, h = config.corpus, config.heads
    out = h.work_dir / "distill" / CONVERSATIONS
    if out.exists():
        print(f"{out} exists; move it away first", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(str(h.target))
    prompts = load_prompt_file(c.prompts)
    ids = [p.id for p in prompts]
    encoded = {p.id: tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in prompts}
    answers = stored_answers(Path(args.datastore))
    order: list[str] = []
    runs = 0
    for prefixes, ks in RUNS:
        more = [a for a in run_order(prefixes, ks, ids, encoded) if not is_held_out(prompt_of(a), c.held_out)]
        if len(order) + len(more) > len(answers):
            break
        order += more
        runs += 1
    if len(order) != len(answers):
        print(f"the datastore holds {len(answers)} answers; no prefix of the known runs gives that many "
              f"(longest fit: {len(order)})", file=sys.stderr)
        return 1
    convs = [{"id": a, "prompt_ids": list(encoded[prompt_of(a)]), "response_ids": r} for a, r in zip(order, answers)]
    model = AutoModelForCausalLM.from_pretrained(str(h.target), dtype=torch.bfloat16).eval()
    greedy = [cv for cv in convs if "#" not in cv["id"]]
    for cv in random.Random(0).sample(greedy, min(args.check, len(greedy))):
        with torch.no_grad():
            argmax = model(torch.tensor([cv["prompt_ids"] + cv["response_ids"]])).logits[0].argmax(-1)
        p = len(cv["prompt_ids"])
        agree = float((argmax[p - 1:-1] == torch.tensor(cv["response_ids"])).float().mean())
        if agree < MIN_AGREEMENT:
            print(f"{cv['id']}: the stored answer agrees with the target's greedy tokens on {agree:.3f} of them "
                  f"(expected >= {MIN_AGREEMENT}): the run order does not match this datastore", file=sys.stderr)
            return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for cv in convs:
            fh.write(json.dumps(cv) + "\n")
    print(f"{out}: {len(convs)} answers, the first {runs} of {len(RUNS)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
