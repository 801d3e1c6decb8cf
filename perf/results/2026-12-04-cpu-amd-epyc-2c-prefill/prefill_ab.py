"""Time to first token of the SmolLM2 default (bf16, 2 threads) by prompt length, with the row-invariant attention
kernel before (4850173: every key past the prefix gathered per row) and after (b4563e9, a53f730: keys every row takes
in slot order loaded once for all rows), alternating in one process, every output compared bit for bit. What is timed
is the decoder's first forward: the whole prompt as one segment, logits for its last row (`forward_segments`).

    git show 4850173:plugins/tree_attention/invariant.c > /tmp/old.c
    cc -O3 -march=native -fPIC -shared -std=gnu11 -fopenmp -o /tmp/old.so /tmp/old.c -lm
    python perf/results/2026-12-04-cpu-amd-epyc-2c-prefill/prefill_ab.py /tmp/old.so perf/results/2026-12-04-cpu-amd-epyc-2c-prefill
    python perf/results/2026-12-04-cpu-amd-epyc-2c-prefill/prefill_ab.py --plot perf/results/2026-12-04-cpu-amd-epyc-2c-prefill
"""
import ctypes
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

LENGTHS = (128, 512, 1024, 2048)


def measure(old_library: str, out: Path) -> None:
    from perf.bench import BenchConfig, load_target
    from plugins import native_build
    from plugins.tree_attention import native
    from runtime.model import Segment, causal_mask

    torch.set_num_threads(2)
    real = native._library  # the module's Lazy; each timed forward swaps in one holding the kernel under test
    new = native.load()
    lib = ctypes.CDLL(old_library)
    fn, rounds = lib.spectree_tree_attention, lib.spectree_rounds_weights
    fn.restype, fn.argtypes = new.fn.restype, new.fn.argtypes
    rounds.restype, rounds.argtypes = ctypes.c_int, [ctypes.c_int64, ctypes.c_int]
    old = dataclasses.replace(new, fn=fn, path=Path(old_library), rounds_weights_fn=rounds)
    model = load_target(BenchConfig(config=Path("configs/smollm2.yaml"))).model
    g = torch.Generator().manual_seed(0)
    rows = []
    for length in LENGTHS:
        tokens = torch.randint(0, model.config.vocab_size, (length,), generator=g)
        times, outs = {"before": [], "after": []}, {}
        for rep in range(3 if length <= 1024 else 2):
            order = (("before", old), ("after", new)) if rep % 2 == 0 else (("after", new), ("before", old))
            for name, kernel in order:
                native._library = native_build.Lazy(lambda kernel=kernel: kernel)
                cache = model.new_cache(length + 8)
                cache.reserve(length)
                seg = Segment(cache, tokens, torch.arange(length), causal_mask(length, 1)[0], logits_from=length - 1)
                t = time.perf_counter()
                with torch.inference_mode():
                    ((logits, hidden),) = model.forward_segments([seg])
                times[name].append(time.perf_counter() - t)
                outs.setdefault(name, (logits.clone(), hidden.clone()))
        row = {"prompt_tokens": length, "before_s": min(times["before"]), "after_s": min(times["after"]),
               "identical": all(torch.equal(a, b) for a, b in zip(outs["before"], outs["after"]))}
        row["speedup"] = row["before_s"] / row["after_s"]
        print(row, flush=True)
        rows.append(row)
    native._library = real
    (out / "prefill_ab.json").write_text(json.dumps(rows, indent=1) + "\n")


def plot(out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads((out / "prefill_ab.json").read_text())
    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["before_s"] for r in rows], "o-", label="before (tree keys gathered per row)")
    ax.plot(x, [r["after_s"] for r in rows], "o-", label="after (shared run loaded once)")
    for r in rows:
        ax.annotate(f'{r["speedup"]:.2f}x', (r["prompt_tokens"], r["after_s"]), textcoords="offset points",
                    xytext=(0, -14), ha="center", fontsize=8)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("SmolLM2-135M bf16 prefill, 2 AMD EPYC cores")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "prefill_ab.png", dpi=110)


if __name__ == "__main__":
    if sys.argv[1] == "--plot":
        plot(Path(sys.argv[2]))
    else:
        measure(sys.argv[1], Path(sys.argv[2]))
