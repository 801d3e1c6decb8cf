"""`python -m perf verify-cost`: what one target forward over N new tokens costs, against N = 1.

Speculative decoding pays off when verifying N drafted tokens in one forward costs little more than decoding one
token: on hardware where a forward is bound by reading the weights, verify(N) / verify(1) stays near 1.0 up to
some N; where it is compute-bound (or dominated by per-token work) it grows with N. This measures that ratio
directly, for each dtype asked for, with two masks over the N new tokens:
    chain   a causal chain (`runtime.model.causal_mask(N)`), positions context + 0..N-1
    tree    a random tree of N nodes (`plugins.tree_attention.mask.random_parents`, `ancestor_mask`, packed),
            positions context + depth; the same tree for every dtype
A dtype is a name `runtime.config.choose_dtype` takes (`auto` is reported as what it chose).
Each dtype's target is loaded once (`TargetModel.from_pretrained(dir, dtype=...)`) and `context` random tokens
are prefilled into its cache. A timing is one `model.forward(tokens [1, N], positions, cache, mask)`: it writes
the N tokens' K/V at [length, length + N) without committing them, so the cache does not advance and every call
sees the same context. After `warmup` untimed passes, each of `repeats` passes times every (dtype, mask, N) once
in a shuffled order (seeded), so a drift of the machine hits all of them alike; a case's time is the median.

The timing logic (`schedule`, `time_cases`, `summarize`) is pure (a fake clock tests it); `run_verify_cost`
loads the models, builds the inputs and returns the JSON-ready report; perf.report / perf.plots turn that into
verify_cost.md and verify_cost.png.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perf import stats
from perf.machine import machine_info, report_header, settings_dict, torch_threads, usable_cores
from runtime import schema
from runtime.config import DTYPE_CHOICES, TARGET_QUANTIZATIONS
from runtime.errors import ConfigError
from runtime.files import shown_path
from runtime.schema import setting

DTYPES = DTYPE_CHOICES
MASKS = ("chain", "tree")
REPORT_FORMAT = "spectree-verify-cost"
REPORT_VERSION = 1


@dataclass(frozen=True)
class VerifyCostConfig:
    """Everything `python -m perf verify-cost` takes (its flags' defaults come from here)."""

    config: Path | None = None  # builder YAML (its model.checkpoint); exactly one of config / checkpoint
    checkpoint: Path | None = None  # HF checkpoint directory
    # each as runtime.config.choose_dtype resolves it; one that resolves to an earlier one's dtype is measured once
    dtypes: tuple[str, ...] = ("float32", "auto")
    context: int = setting(256, ge=1)  # tokens prefilled into the cache before the timed forwards
    # N: new tokens per forward; must include 1
    sizes: tuple[int, ...] = setting((1, 2, 4, 8, 16, 32, 64), nonempty=True)
    repeats: int = setting(7, ge=1)  # timed passes over every (dtype, mask, N); the median counts
    warmup: int = setting(1, ge=0)  # untimed passes first
    threads: int | None = setting(None, ge=1)  # torch intra-op threads; None: every usable core
    device: str = setting("cpu", pattern=r"cpu|cuda(:.*)?", what="cpu, cuda or cuda:K")
    seed: int = 0  # random context, tokens, trees and the order within each pass
    profile: tuple[int, ...] = ()  # N whose chain forward is also run under torch.profiler (op-time breakdown)
    # the target with block-quantised weights too (runtime.model.quantize_weights), in these formats, each loaded in
    # the last of `dtypes` and labelled "<dtype> <format>" (the weights q4, say, multiplied with the dtype's rows)
    target_quantizations: tuple[str, ...] = ()
    # llama.cpp as the target too (plugins/llama_cpp), at these precisions (perf.llama_cpp.PRECISIONS) of the GGUF
    # the checkpoint was imported from (llama_cpp_gguf; None: the shipped SmolLM2 file): one decode of the N tokens
    llama_cpp: tuple[str, ...] = ()
    llama_cpp_gguf: Path | None = None
    # output directory; {date} and {machine} are filled in
    out: str = setting("out/perf/{date}-{machine}", nonempty=True, what="an output directory")

    def __post_init__(self) -> None:
        if (self.config is None) == (self.checkpoint is None):
            raise ConfigError("give exactly one of --config (a builder YAML) or --checkpoint (a checkpoint "
                                  f"directory), got config={self.config!r}, checkpoint={self.checkpoint!r}")
        schema.check(self, ConfigError)
        if not self.dtypes or any(d not in DTYPES for d in self.dtypes) or len(set(self.dtypes)) != len(self.dtypes):
            raise ConfigError(f"dtypes: got {list(self.dtypes)}, expected distinct names among "
                                  f"{', '.join(DTYPES)}")
        if min(self.sizes) < 1 or len(set(self.sizes)) != len(self.sizes):
            raise ConfigError(f"sizes: got {list(self.sizes)}, expected distinct integers >= 1")
        if 1 not in self.sizes:
            raise ConfigError(f"sizes: got {list(self.sizes)}, expected a list including 1 (the ratios are "
                                  "verify(N) / verify(1))")
        tq = self.target_quantizations
        if any(q not in TARGET_QUANTIZATIONS for q in tq) or len(set(tq)) != len(tq):
            raise ConfigError(f"target_quantizations: got {list(tq)}, expected distinct names among "
                              f"{', '.join(TARGET_QUANTIZATIONS)}")
        if self.llama_cpp:
            from perf.llama_cpp import check_precisions

            check_precisions(self.llama_cpp)
        if any(n not in self.sizes for n in self.profile):
            raise ConfigError(f"profile: got {list(self.profile)}, expected sizes among --sizes "
                                  f"{sorted(self.sizes)}")

    def resolved_threads(self) -> int:
        return self.threads if self.threads is not None else usable_cores()

    def to_dict(self) -> dict[str, Any]:
        d = settings_dict(self)
        d["sizes"] = sorted(self.sizes)
        return d


def parse_list(text: str, name: str, item: Callable[[str], Any]) -> tuple[Any, ...]:
    """A comma-separated flag value ("1,2,4", "float32,bfloat16"); ConfigError names the flag."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        values = tuple(item(p) for p in parts)
    except ValueError as exc:
        raise ConfigError(f"--{name}: got {text!r}, expected a comma-separated list ({exc})") from exc
    if not values:
        raise ConfigError(f"--{name}: got {text!r}, expected a comma-separated list")
    return values


# ---- the forwards' inputs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    dtype: str
    mask: str  # chain | tree
    size: int  # N


@dataclass(frozen=True)
class VerifyInput:
    """One forward's new tokens: ids, positions and the packed mask over them (CPU tensors)."""

    tokens: torch.Tensor  # [1, N] int64
    positions: torch.Tensor  # [1, N] int64
    mask: torch.Tensor  # [1, N, ceil(N / 32)] int32
    parents: tuple[int, ...]  # the tree's parent list (chain: i - 1)

    @property
    def depth(self) -> int:
        """Deepest node's depth (root 0)."""
        return int(self.positions.max() - self.positions.min())


def verify_input(mask: str, size: int, context: int, vocab_size: int, generator: torch.Generator) -> VerifyInput:
    from plugins.tree_attention.mask import ancestor_mask, pack_mask, random_parents
    from runtime.model import causal_mask

    tokens = torch.randint(0, vocab_size, (1, size), generator=generator)
    if mask == "chain":
        parents = tuple(range(-1, size - 1))
        return VerifyInput(tokens, torch.arange(context, context + size).unsqueeze(0), causal_mask(size), parents)
    if mask != "tree":
        raise ValueError(f"mask: got {mask!r}, expected one of {MASKS}")
    parents = tuple(random_parents(size, generator))
    ancestors = ancestor_mask(list(parents))  # [N, N]: a node and its ancestors
    depth = ancestors.sum(-1) - 1
    return VerifyInput(tokens, (context + depth).unsqueeze(0), pack_mask(ancestors).unsqueeze(0), parents)


# ---- timing (pure) ------------------------------------------------------------------------------------------


def schedule(cases: Sequence[Case], repeats: int, seed: int) -> list[list[Case]]:
    """`repeats` passes over every case, each in its own seeded shuffled order."""
    rng = random.Random(seed)
    order = []
    for _ in range(repeats):
        shuffled = list(cases)
        rng.shuffle(shuffled)
        order.append(shuffled)
    return order


def time_cases(call: Callable[[Case], None], passes: Sequence[Sequence[Case]],
               clock: Callable[[], float] = time.perf_counter,
               progress: Callable[[str], None] | None = None) -> dict[Case, list[float]]:
    """Seconds of `call(case)` for every case of every pass, in order; `call` must finish its work (a device
    sync) before returning."""
    samples: dict[Case, list[float]] = {}
    for i, cases in enumerate(passes):
        for case in cases:
            t0 = clock()
            call(case)
            samples.setdefault(case, []).append(clock() - t0)
            if progress:
                progress(f"pass {i + 1}: {case.dtype} {case.mask} N={case.size}")
    return samples


def summarize(samples: Mapping[Case, Sequence[float]]) -> list[dict[str, Any]]:
    """Per case (sorted by dtype as given, mask, N): median and min ms, every sample, and the ratio of its median
    to the same dtype and mask's N = 1 median."""
    one = {(c.dtype, c.mask): stats.median(s) for c, s in samples.items() if c.size == 1}
    dtypes = list(dict.fromkeys(c.dtype for c in samples))
    rows = []
    for c in sorted(samples, key=lambda c: (dtypes.index(c.dtype), MASKS.index(c.mask), c.size)):
        med = stats.median(samples[c])
        rows.append({"dtype": c.dtype, "mask": c.mask, "size": c.size, "median_ms": 1e3 * med,
                     "min_ms": 1e3 * min(samples[c]), "samples_ms": [1e3 * t for t in samples[c]],
                     "ratio": stats.ratio(med, one.get((c.dtype, c.mask)))})
    return rows


# ---- where a forward's time goes ------------------------------------------------------------------------------

# Self time of these ops is "matmul" / "attention"; everything else (norms, RoPE, copies, views, casts, the
# dispatcher's bookkeeping of small ops) is the per-step overhead a lean step removes. The tree-attention op's own self
# time is attention too: the row-invariant CPU kernel runs inside it (a ctypes call, no profiled child op); on the SDPA
# route it is the op's input checks and mask.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_weight_int8pack_mm",
              "aten::_weight_int4pack_mm_for_cpu", "mkldnn::_linear_pointwise", "spectree::stream_linear")
# Whole decoder layers in one native call (plugins/decoder_layer: one layer, or the stack's run of layers): their
# matmuls, attention and small ops together
LAYER_OPS = ("spectree::decoder_layer",)
# The native calls the runtime makes through ctypes, which the profiler cannot see: named for it while profiling
# (module, function, op name)
_NATIVE_CALLS = (("plugins.stream_linear.native", "linear", "spectree::stream_linear"),
                 ("plugins.decoder_layer.native", "stack_forward", "spectree::decoder_layer"))
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
                 "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_flash_attention",
                 "aten::_scaled_dot_product_cudnn_attention", "spectree::tree_attention")


def op_breakdown(self_times_us: Mapping[str, float], calls: int, top: int = 8) -> dict[str, Any]:
    """Per-forward self time by op class from profiler totals over `calls` forwards (op name -> microseconds)."""
    total = sum(self_times_us.values())
    groups = {"matmul": 0.0, "attention": 0.0, "native_layer": 0.0, "other": 0.0}
    for name, us in self_times_us.items():
        groups["matmul" if name in MATMUL_OPS else "attention" if name in ATTENTION_OPS
               else "native_layer" if name in LAYER_OPS else "other"] += us
    others = sorted(((n, us) for n, us in self_times_us.items() if n not in MATMUL_OPS + ATTENTION_OPS + LAYER_OPS),
                    key=lambda kv: -kv[1])[:top]
    return {"ms_per_forward": total / calls / 1000,
            "share": {k: v / total if total else 0.0 for k, v in groups.items()},
            "top_other": [{"op": n, "ms_per_forward": us / calls / 1000} for n, us in others]}


def profile_case(call: Callable[[Case], None], case: Case, calls: int) -> dict[str, Any]:
    """Run `case` `calls` times under torch.profiler (CPU activity) and break its self time down by op class."""
    import contextlib
    import functools
    import importlib

    from torch.profiler import ProfilerActivity, profile, record_function

    def named(fn: Callable, op: str) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with record_function(op):
                return fn(*args, **kwargs)
        return wrapper

    with contextlib.ExitStack() as undo:
        for module_name, attr, op in _NATIVE_CALLS:
            module = importlib.import_module(module_name)
            real = getattr(module, attr)
            setattr(module, attr, named(real, op))
            undo.callback(setattr, module, attr, real)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                call(case)
    totals = {e.key: float(e.self_cpu_time_total) for e in prof.key_averages()}
    return {"dtype": case.dtype, "mask": case.mask, "size": case.size, **op_breakdown(totals, calls)}


# ---- the measurement ----------------------------------------------------------------------------------------


def checkpoint_path(config: VerifyCostConfig) -> Path:
    if config.checkpoint is not None:
        return config.checkpoint
    from builder.config import load_config

    return load_config(config.config).model.checkpoint


def llama_cpp_targets(config: VerifyCostConfig, prefix: list[int], need: int) -> dict[str, Any]:
    """"llama.cpp PREC" -> an executor on that precision's GGUF, `prefix` decoded into its cache."""
    from perf import llama_cpp
    from plugins.llama_cpp import ExecutorConfig, LlamaCppExecutor, available
    from runtime.llama_cpp_decode import prefill

    why = available()
    if why is not None:
        raise ConfigError(f"llama_cpp: {why}")
    binaries = llama_cpp.find_binaries()
    source = llama_cpp.source_gguf(config.llama_cpp_gguf)
    out = {}
    for p in config.llama_cpp:
        path = llama_cpp.gguf_for(p, source, binaries, binaries.directory.parent / "models")
        ex = LlamaCppExecutor(ExecutorConfig(model=str(path), n_ctx=need + 8, n_batch=max(512, max(config.sizes) + 2),
                                             n_seq=max(config.sizes) + 2, threads=config.resolved_threads()))
        prefill(ex, prefix)
        out[f"{llama_cpp.ENGINE} {llama_cpp.PRECISIONS[p]}"] = ex
    return out


STREAM_BYTES = 1 << 29  # the buffer the machine's read bandwidth is measured on: far beyond any cache


def weight_bytes(model: Any) -> int:
    """Bytes of weights a one-token forward of `model` (runtime TargetModel) reads: every matmul's weights as they
    run (dense, packed or block-quantised), the lm_head's once (tied or not); the embedding's one row is left out."""
    from runtime.model import BlockWeight, PackedWeight

    def size(w: Any) -> int:
        if isinstance(w, BlockWeight):
            return w.nbytes()
        t = w.weight if isinstance(w, PackedWeight) else w
        return t.numel() * t.element_size()

    total = 0
    for layer in model.model.layers:
        for mod in (layer.self_attn, layer.mlp):
            total += sum(size(w) for w in mod._weights(getattr(mod, mod._out_name).weight))
    head = model._block_lm_head or model.lm_head_weight
    return total + size(head)


def stream_read_gbps(repeats: int = 5) -> float:
    """What this machine streams from memory with torch's threads: the best of `repeats` reductions over a float32
    buffer of STREAM_BYTES (a read-only pass, as a forward's weight reads are), in GB/s."""
    x = torch.ones(STREAM_BYTES // 4)
    best = float("inf")
    for _ in range(repeats + 1):  # the first pass faults the pages in
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return STREAM_BYTES / best / 1e9


def bandwidth(models: Mapping[str, Any], results: Sequence[Mapping[str, Any]], stream_gbps: float) -> dict[str, Any]:
    """Per dtype measured: the weights a one-token forward reads, at the N = 1 chain median, as GB/s and as a fraction
    of what the machine streams."""
    one = {r["dtype"]: r["median_ms"] for r in results if r["mask"] == "chain" and r["size"] == 1}
    out = {}
    for d, model in models.items():
        b = weight_bytes(model)
        gbps = b / (one[d] / 1e3) / 1e9
        out[d] = {"weight_bytes": b, "one_token_ms": one[d], "gbps": gbps, "fraction_of_stream": gbps / stream_gbps}
    return {"stream_gbps": stream_gbps, "stream_bytes": STREAM_BYTES, "by_dtype": out}


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def run_verify_cost(config: VerifyCostConfig,
                    progress_factory: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Load the target once per dtype, prefill, time every case; returns the report (JSON-ready). Sets torch's
    threads for the duration."""
    from runtime.model import TargetModel

    if config.device != "cpu" and not torch.cuda.is_available():
        raise ConfigError(f"device: got {config.device!r}, but torch sees no CUDA device here")
    device = torch.device(config.device)
    path = checkpoint_path(config)
    with torch_threads(config.resolved_threads()):
        # the dtype that runs (`auto` as what it chose) -> model; a dtype asked for twice is measured once
        models = {}
        for d in config.dtypes:
            model = TargetModel.from_pretrained(path, dtype=d, device=device)
            models.setdefault(model.config.dtype, model)
        for q in config.target_quantizations:
            model = TargetModel.from_pretrained(path, dtype=config.dtypes[-1], device=device)
            model.quantize_weights(q)
            models[f"{model.config.dtype} {q}"] = model
        labels = list(models)
        c = next(iter(models.values())).config
        need = config.context + max(config.sizes)
        if need > c.max_context:
            raise ConfigError(f"context {config.context} + the largest size {max(config.sizes)} = {need} "
                                  f"exceeds the model's context of {c.max_context} tokens; lower --context or "
                                  "--sizes")
        gen = torch.Generator().manual_seed(config.seed)
        prefix = torch.randint(0, c.vocab_size, (1, config.context), generator=gen)
        inputs = {(m, n): verify_input(m, n, config.context, c.vocab_size, gen)
                  for m in MASKS for n in sorted(config.sizes)}
        caches, on_device = {}, {}
        for d, model in models.items():
            caches[d] = model.new_cache(need)
            model.prefill(prefix.to(device), caches[d])
        for key, inp in inputs.items():
            on_device[key] = (inp.tokens.to(device), inp.positions.to(device), inp.mask.to(device))
        sync = _sync(device)
        executors = llama_cpp_targets(config, prefix[0].tolist(), need) if config.llama_cpp else {}
        labels += list(executors)
        seqs: dict[tuple[str, int], list[tuple[int, ...]]] = {}
        if executors:
            from runtime.llama_cpp_decode import COMMITTED, decode_tree, leaf_sequences

            # a chain in the committed sequence, a tree in its leaves' (runtime.llama_cpp_decode)
            seqs = {(m, n): [(COMMITTED,)] * n if m == "chain" else leaf_sequences(inp.parents)
                    for (m, n), inp in inputs.items()}

        def call(case: Case) -> None:
            if case.dtype in executors:  # the N tokens decoded, then dropped from the cache
                ex, inp = executors[case.dtype], inputs[(case.mask, case.size)]
                decode_tree(ex, inp.tokens[0].tolist(), inp.positions[0].tolist(), seqs[(case.mask, case.size)],
                            [True] * case.size)
                ex.seq_rm(COMMITTED, config.context)
                return
            tokens, positions, mask = on_device[(case.mask, case.size)]
            models[case.dtype].forward(tokens, positions, caches[case.dtype], mask)
            sync()

        cases = [Case(d, m, n) for d in labels for m in MASKS for n in sorted(config.sizes)]
        warm = schedule(cases, config.warmup, config.seed + 1)
        timed = schedule(cases, config.repeats, config.seed)
        started = time.perf_counter()
        if progress_factory is not None:
            with progress_factory(len(cases) * (config.warmup + config.repeats)) as advance:
                time_cases(call, warm, progress=lambda text: advance(f"warm-up {text}"))
                samples = time_cases(call, timed, progress=advance)
        else:
            time_cases(call, warm)
            samples = time_cases(call, timed)
        elapsed = time.perf_counter() - started
        profiles = [profile_case(call, Case(d, "chain", n), config.repeats)
                    for d in labels if d not in executors for n in sorted(config.profile)]
        for ex in executors.values():
            ex.close()
        if any(cache.length != config.context for cache in caches.values()):
            raise RuntimeError("the cache advanced during the timed forwards; every forward must see the same context")
        results = summarize(samples)
        reads = bandwidth(models, results, stream_read_gbps()) if device.type == "cpu" else None
        machine = machine_info()
    return {
        **report_header(REPORT_FORMAT, REPORT_VERSION, config.to_dict(), machine),
        "target": {"path": shown_path(path), "architecture": c.architecture,
                   "parameters": sum(p.numel() for p in next(iter(models.values())).parameters()),
                   "num_hidden_layers": c.num_hidden_layers,
                   "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "device": str(device)},
        "measure_seconds": elapsed,
        "trees": {str(n): {"depth": inputs[("tree", n)].depth, "parents": list(inputs[("tree", n)].parents)}
                  for n in sorted(config.sizes)},
        "results": results,
        "bandwidth": reads,
        "profile": profiles,
    }


__all__ = [
    "DTYPES",
    "MASKS",
    "Case",
    "VerifyCostConfig",
    "VerifyInput",
    "bandwidth",
    "stream_read_gbps",
    "weight_bytes",
    "checkpoint_path",
    "llama_cpp_targets",
    "op_breakdown",
    "profile_case",
    "parse_list",
    "run_verify_cost",
    "schedule",
    "summarize",
    "time_cases",
    "verify_input",
]
