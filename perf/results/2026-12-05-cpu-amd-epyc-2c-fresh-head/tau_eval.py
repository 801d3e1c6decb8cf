"""tau of the configured drafter with several engines (one per head) on prompt files, decoding only: greedy, 128
tokens, EOS ignored, 2 threads. Every output must be identical across engines (it is the target's greedy output).

    python perf/results/2026-12-05-cpu-amd-epyc-2c-fresh-head/tau_eval.py ENGINE[,ENGINE...] PROMPTS[,PROMPTS...]

Prints, per engine, tau over all prompts (emitted tokens after the first / verification steps) and the mean per
prompt over the ids with and without "code" in them.
"""

import sys
import time

import torch

import runtime
from runtime.prompts import load_prompt_file
from runtime.tokenizer import single_turn


def main() -> None:
    torch.set_num_threads(2)
    engines, files = sys.argv[1].split(","), sys.argv[2].split(",")
    prompts = [p for f in files for p in load_prompt_file(f)]
    outputs: dict[str, set] = {}
    for eng in engines:
        dec = runtime.load(eng)
        gen = steps = 0
        per = {}
        t0 = time.time()
        for p in prompts:
            r = dec.generate(single_turn(p.text), max_tokens=128, ignore_eos=True)
            gen += r.stats.generated_tokens - 1
            steps += r.stats.steps
            per[p.id] = (r.stats.generated_tokens - 1) / max(r.stats.steps, 1)
            outputs.setdefault(p.id, set()).add(tuple(r.token_ids))
        code = [v for k, v in per.items() if "code" in k]
        chat = [v for k, v in per.items() if "code" not in k]
        print(f"{eng}: tau {gen / steps:.3f} (steps {steps}; mean per prompt code {sum(code) / max(len(code), 1):.3f} "
              f"chat {sum(chat) / max(len(chat), 1):.3f}) {time.time() - t0:.0f}s", flush=True)
    print("identical:", all(len(v) == 1 for v in outputs.values()))


if __name__ == "__main__":
    main()
