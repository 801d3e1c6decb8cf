"""tau of the configured drafter with several engines (heads) on prompt files, decoding only (greedy, 128 tokens,
EOS ignored); every output must be identical across engines."""
import json, sys, time
import torch
import runtime
from runtime.prompts import load_prompt_file
from runtime.tokenizer import single_turn

torch.set_num_threads(2)
engines, files = sys.argv[1].split(","), sys.argv[2].split(",")
prompts = [p for f in files for p in load_prompt_file(f)]
outputs = {}
for eng in engines:
    dec = runtime.load(eng)
    gen = steps = 0
    per = {}
    t0 = time.time()
    for p in prompts:
        r = dec.generate(single_turn(p.text), max_tokens=128, ignore_eos=True)
        s = r.stats
        gen += s.generated_tokens - 1
        steps += s.steps
        per[p.id] = (s.generated_tokens - 1) / max(s.steps, 1)
        outputs.setdefault(p.id, set()).add(tuple(r.token_ids))
    code = [v for k, v in per.items() if "code" in k]
    chat = [v for k, v in per.items() if "code" not in k]
    print(f"{eng}: tau {gen / steps:.3f} (steps {steps}; mean per prompt code {sum(code)/max(len(code),1):.3f} "
          f"chat {sum(chat)/max(len(chat),1):.3f}) {time.time() - t0:.0f}s", flush=True)
print("identical:", all(len(v) == 1 for v in outputs.values()))
