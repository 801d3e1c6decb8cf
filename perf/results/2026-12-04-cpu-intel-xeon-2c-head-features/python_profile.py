# Run from the repository root. Unprofiled ms per step, then cProfile of plain decoding and of the configured drafter
# (4 merge-tuning prompts, 96 tokens): Python self time per function per step.
import sys, time, cProfile, pstats
sys.path.insert(0, '.')
import torch
torch.set_num_threads(2)
from pathlib import Path
from perf.bench import BenchConfig, load_target, build_decoder, resolve, VariantSpec, encode_prompt
from runtime.prompts import load_prompt_file
cfg = BenchConfig(config=Path('configs/smollm2.yaml'), threads=2)
target = load_target(cfg)
prompts = load_prompt_file('demo/smollm2/prompts/merge-tuning.jsonl')[0:44:11]
enc = [encode_prompt(target.tokenizer, p) for p in prompts]
spec = resolve(VariantSpec.parse('eagle'), target, {})
dec, _ = build_decoder(target, spec)
plain, _ = build_decoder(target, None)
for d in (dec, plain): d.generate(enc[0], max_tokens=32, ignore_eos=True)
for name, d in (('plain', plain), ('spec', dec)):
    steps = 0; t = time.perf_counter()
    for ids in enc:
        r = d.generate(ids, max_tokens=96, ignore_eos=True); steps += r.stats.steps
    print(name, 'unprofiled ms/step', (time.perf_counter() - t) / steps * 1e3)
for name, d in (('plain', plain), ('spec', dec)):
    pr = cProfile.Profile(); steps = 0
    pr.enable()
    for ids in enc:
        r = d.generate(ids, max_tokens=96, ignore_eos=True); steps += r.stats.steps
    pr.disable()
    st = pstats.Stats(pr); print('=====', name, steps, 'steps; total', st.total_tt / steps * 1e3, 'ms/step')
    st.sort_stats('tottime')
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:45]
    for (f, l, fn), (cc, nc, tt, ct, callers) in rows:
        print(f"{tt/steps*1e3:7.3f} ms/step self {ct/steps*1e3:7.3f} cum {nc/steps:6.1f} calls/step  {Path(f).name}:{l} {fn}")
