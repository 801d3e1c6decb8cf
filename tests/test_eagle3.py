"""EAGLE-3 heads in the public layout (runtime/drafters/eagle3.py): our forward against a reference written from the
published module structure, the target's feature layers against transformers' hidden states, drafting against the
reference's drafts, losslessness (greedy identity; the sampled law, with a negative control), and the errors of bad
head directories.

What the public layout is was read in these sources (the loader and the reference follow them):
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import runtime
from plugins.draft_layer import native as native_layer
from runtime.draft_spec import DraftSpec
from runtime.drafters import load_drafter
from runtime.drafters.draft_vocab import DraftVocab
from runtime.drafters.eagle3 import default_feature_layers, feature_layers, load_eagle3_head
from runtime.errors import CheckpointError
from runtime.model import Segment, TargetModel, causal_mask
from runtime.sampling import SamplingParams
from runtime.tree import Tree
from tests.heads import load_eagle3_reference, write_eagle3_head, write_eagle_head
from tests.test_decode import PROMPTS, chi2_threshold, distribution_stat, lossy_verify
from tests.tiny import make_checkpoint

# (repository, commit, path): what each says about the layout. Facts, not code: nothing here is copied.
SOURCES = {
    "reference": ("SafeAILab/EAGLE", "148042c5fed07822194a49b027c897c9c5494b0e", "eagle/model/cnets.py",
                  "Model: fc Linear(3 * (target_hidden_size or hidden_size), hidden_size, bias=False); midlayer = "
                  "LlamaDecoderLayeremb (hidden_norm, input_layernorm, self_attn with q/k/v Linear(2H, ...), "
                  "post_attention_layernorm, mlp); residual = the feature; cat(input_emb, hidden) embedding first; "
                  "norm; lm_head Linear(H, draft_vocab_size); buffers d2t [K] long, t2d [V] bool; target id = "
                  "draft id + d2t[draft id]; deeper draft steps feed the layer's pre-norm output, not fc"),
    "train_config": ("SafeAILab/EAGLE", "9666a8182d9bed8b5b637fd4a126c90d9b9c3db2", "eagle/traineagle3/config.json",
                     "Llama fields, num_hidden_layers 1, vocab_size (the target's), draft_vocab_size"),
    "vllm": ("vllm-project/vllm", "00bd1493b3e82d6c13c68ee8a0e1c5a96707e190",
             "vllm/model_executor/models/llama_eagle3.py",
             "midlayer. -> layers.0.; t2d skipped; d2t -> draft_id_to_target_id; embed_tokens optional (else the "
             "target's); fc input target_hidden_size * 3 when present; norm_before_residual; attention_bias; "
             "draft_vocab_size defaults to vocab_size"),
    "vllm_aux": ("vllm-project/vllm", "(stored version, read through the code search)",
                 "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py and vllm/model_executor/models/llama.py",
                 "eagle_aux_hidden_state_layer_ids (draft config, top level) are layer indices whose INPUT "
                 "(hidden_states + residual before layer idx) is captured; default (2, L // 2, L - 3), appended in "
                 "layer order"),
    "sglang": ("sgl-project/sglang", "03d5a7771f6082e7737a5f19cae7d1e863087013",
               "python/sglang/srt/models/llama_eagle3.py",
               "LlamaForCausalLMEagle3 (EntryClass); fc bias = config 'bias' (default False); d2t -> hot token ids; "
               "t2d skipped; lm_head over draft_vocab_size (None: the target's); midlayer residual = the feature"),
    "sglang_aux": ("sgl-project/sglang", "(stored versions, read through the code search)",
                   "python/sglang/srt/model_executor/model_runner.py, python/sglang/srt/models/llama.py",
                   "eagle_config['eagle_aux_hidden_state_layer_ids'] from the draft config; set_eagle3_layers_to_"
                   "capture adds 1 to each (the layer whose OUTPUT is taken); default [2, L // 2, L - 3] as inputs"),
    "trtllm": ("NVIDIA/TensorRT-LLM", "00679c66c3e38f6d2651ad0a5bef0f94d862e36c",
               "tensorrt_llm/_torch/models/modeling_speculative.py",
               "Eagle3DraftModel: fc Linear(hidden_size_in * num_capture_layers, H, bias=config.bias); midlayer "
               "(hidden_norm, input_layernorm, qkv over 2H, post_attention_layernorm); 'layers.0.' remapped to "
               "'midlayer.'; lm_head loaded from the target when absent; embed_tokens shared unless "
               "target_hidden_size differs; d2t when draft_vocab_size != vocab_size"),
}
__doc__ += "\n".join(f"    {name}: {repo}@{commit[:12]} {path}" for name, (repo, commit, path, _) in SOURCES.items())

LAYERS = 8  # the target's layers: the default feature layers (2, 4, 5) are three distinct ones


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target3"), "llama3", seed=5, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def target(target_dir):
    return TargetModel.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    return model.eval().requires_grad_(False)


def hf_features(hf, ids: list[int], layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' (final-norm hidden # [T, H], the streams entering `layers` concatenated # [T, 3H]): its
    hidden_states[j] is the input of layer j."""
    with torch.no_grad():
        out = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.last_hidden_state[0], torch.cat([out.hidden_states[j][0] for j in layers], dim=-1)


def our_rows(model: TargetModel, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """Our target's hidden-state rows for a drafter reading `layers` # [T, H * (1 + 3)]."""
    n = len(ids)
    seg = Segment(model.new_cache(n), torch.tensor(ids), torch.arange(n), causal_mask(n)[0], feature_layers=layers)
    return model.forward_segments([seg])[0][1]


def test_sources_are_recorded():
    assert all(len(commit) >= 12 or commit.startswith("(") for _, commit, _, _ in SOURCES.values())


def test_feature_layers_are_the_streams_transformers_reports(target, hf_target):
    ids = PROMPTS[2]
    hidden, feats = hf_features(hf_target, ids, (0, 2, 4, 5, 7))
    rows = our_rows(target, ids, (0, 2, 4, 5, 7))
    h = target.config.hidden_size
    assert rows.shape == (len(ids), 6 * h)
    torch.testing.assert_close(rows[:, :h], hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rows[:, h:], feats, atol=1e-5, rtol=1e-5)
    # the last layer's output (before the final norm) is layer L's feature; asking for features changes no logit
    plain = target.forward_segments([Segment(target.new_cache(len(ids)), torch.tensor(ids), torch.arange(len(ids)),
                                             causal_mask(len(ids))[0])])[0]
    tapped = target.forward_segments([Segment(target.new_cache(len(ids)), torch.tensor(ids), torch.arange(len(ids)),
                                              causal_mask(len(ids))[0], feature_layers=(LAYERS,))])[0]
    assert torch.equal(plain[0], tapped[0]) and torch.equal(plain[1], tapped[1][:, :h])
    assert not torch.equal(tapped[1][:, h:], tapped[1][:, :h])  # the pre-norm stream, not the final-norm state


@pytest.mark.parametrize("fmt,prefix,with_embedding,reduced", [
    ("safetensors", "midlayer.", False, False),
    ("bin", "midlayer.", True, True),
    ("safetensors", "layers.0.", False, True),
])
def test_head_forward_matches_reference(tmp_path, target_dir, target, hf_target, fmt, prefix, with_embedding,
                                        reduced):
    vocab = DraftVocab(torch.arange(0, 420, 3), 420) if reduced else None
    head_dir = write_eagle3_head(tmp_path / "h", target_dir, fmt=fmt, seed=2, vocab=vocab, layer_prefix=prefix,
                                 with_embedding=with_embedding)
    ref = load_eagle3_reference(head_dir, target_dir)
    drafter = load_drafter(DraftSpec.create("eagle3", path=head_dir, tree="chain-2"), target)
    head = drafter.head
    layers = default_feature_layers(LAYERS)
    assert head.feature_layers == layers == (2, 4, 5)
    ids = PROMPTS[1] + PROMPTS[2]
    t = len(ids)
    _, feats = hf_features(hf_target, ids, layers)
    emb = head.embed_tokens if with_embedding else hf_target.model.embed_tokens
    with torch.no_grad():
        want = ref(feats[:-1], emb(torch.tensor(ids[1:])), torch.arange(t - 1))  # [T-1, H]
        want_logits = ref.logits(want)
    rows = our_rows(target, ids, layers)
    g = drafter.features(rows[:-1])
    embeds = head.embed_tokens(torch.tensor(ids[1:])) if with_embedding else target.embed(torch.tensor(ids[1:]))
    got = head(embeds[None], g[None], torch.arange(t - 1)[None], head.new_cache(t), causal_mask(t - 1))[0]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(drafter.draft_logits(got), want_logits, atol=1e-4, rtol=1e-4)
    top = drafter.to_target(drafter.draft_logits(got).argmax(-1))
    assert torch.equal(top, ref.to_target(want_logits.argmax(-1)))
    if reduced:
        assert set(top.tolist()) <= set(vocab.target_ids.tolist())


def reference_chain(ref, hf, ids: list[int], root: int, depth: int) -> list[int]:
    """The reference's greedy chain after committed ids (x_0 .. x_{L-1}) and root x_L: the root pair reads the
    target's features, each deeper node its parent's output (cnets.py's topK_genrate, top-1 at every level)."""
    layers = default_feature_layers(LAYERS)
    _, feats = hf_features(hf, ids, layers)
    rows = list(feats)
    toks = ids[1:] + [root]
    chain = []
    with torch.no_grad():
        for d in range(depth):
            out = ref.mixed(rows, hf.model.embed_tokens(torch.tensor(toks)), torch.arange(len(toks)))
            nxt = int(ref.to_target(ref.logits(out[-1]).argmax()))
            chain.append(nxt)
            rows.append(out[-1])
            toks.append(nxt)
    return chain


def test_drafts_match_the_reference_over_steps(tmp_path, target_dir, target, hf_target):
    """A chain drafted from the prompt, then again after three committed tokens: the head cache, the features of
    advance() and the deeper nodes' inputs, against the reference recomputing everything."""
    vocab = DraftVocab(torch.arange(1, 420, 2), 420)
    head_dir = write_eagle3_head(tmp_path / "h", target_dir, seed=4, vocab=vocab)
    ref = load_eagle3_reference(head_dir, target_dir)
    drafter = load_drafter(DraftSpec.create("eagle3", path=head_dir, tree="chain-3"), target)
    seq = PROMPTS[2] + PROMPTS[1]
    p = len(PROMPTS[2])
    rows = our_rows(target, seq, drafter.feature_layers)
    session = drafter.start(torch.tensor(seq[:p]), rows[:p], 16)
    draft = session.draft(seq[p])
    assert draft.tokens.tolist() == [seq[p]] + reference_chain(ref, hf_target, seq[:p], seq[p], 3)
    session.advance(torch.tensor(seq[p:p + 3]), rows[p:p + 3])
    draft = session.draft(seq[p + 3])
    assert draft.tokens.tolist() == [seq[p + 3]] + reference_chain(ref, hf_target, seq[:p + 3], seq[p + 3], 3)


# ---- lossless ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, target_dir):
    return write_eagle3_head(tmp_path_factory.mktemp("head3"), target_dir, seed=1)


@pytest.mark.parametrize("tree,opts,quantization", [
    (None, {}, None),
    (None, {"total_tokens": 12, "depth": 3, "top_k": 4}, None),
    ('[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]', {}, None),
    ('[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]', {"min_path_prob": 0.05}, None),
    (None, {"total_tokens": 10, "depth": 3, "top_k": 3}, "int8"),
    ('[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]', {}, "int8"),
    ("chain-3", {"num_draft_tokens": 4}, None),  # prompt lookup merged into its trees
])
def test_greedy_output_is_plain_decoding(target_dir, head_dir, tree, opts, quantization):
    plain = runtime.load(target_dir)
    spec = runtime.load(target_dir, draft_model=head_dir, tree=tree, draft_quantization=quantization, **opts)
    assert spec.drafter.name == "eagle3"  # told by its layout: no draft= given
    assert (spec.drafter.head.native is not None) == (quantization == "int8" and native_layer.load() is not None)
    drafted = 0
    for prompt in PROMPTS[:4]:
        a = plain.generate(prompt, max_tokens=20, ignore_eos=True)
        b = spec.generate(prompt, max_tokens=20, ignore_eos=True)
        assert a.token_ids == b.token_ids
        drafted += b.stats.drafted_tokens
    assert drafted > 0


def test_batched_requests_decode_as_alone(target_dir, head_dir):
    """Requests drafted by an EAGLE-3 head verified together in one forward (the feature layers of a ragged batch)."""
    from runtime.batching import Scheduler
    from runtime.scheduler_config import SchedulerConfig

    plain = runtime.load(target_dir)
    spec = runtime.load(target_dir, draft_model=head_dir, total_tokens=8, depth=3, top_k=3)
    sched = Scheduler(spec, SchedulerConfig(max_concurrent_requests=4))
    try:
        handles = [sched.submit(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in PROMPTS[:4]]
        for prompt, handle in zip(PROMPTS[:4], handles):
            assert handle.result().token_ids == plain.generate(prompt, max_tokens=16, ignore_eos=True).token_ids
    finally:
        sched.close()


def _accepting_head(tmp_path, target_dir, model: TargetModel) -> tuple[Path, list[int]]:
    """A random head whose draft vocabulary is the target's 4 likeliest tokens after PROMPTS[1] + its likeliest
    next token (where the sampled tests' first tree step drafts whenever that token comes first), so that its drafts
    are accepted sometimes and rejected sometimes; the head and those tokens."""
    def top4(seq: list[int]) -> list[int]:
        logits, _ = model.prefill(torch.tensor([seq]), model.new_cache(len(seq)))
        return logits[0, -1].argsort(descending=True)[:4].tolist()

    keep = sorted(top4(PROMPTS[1] + top4(PROMPTS[1])[:1]))
    return write_eagle3_head(tmp_path / "h", target_dir, seed=3, vocab=DraftVocab(torch.tensor(keep), 420)), keep


@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=4), dict(temperature=0.7, top_k=5, top_p=0.95)],
                         ids=["T1.0", "T0.7"])
@pytest.mark.parametrize("quantization", [None, "int8"])  # int8: the midlayer's native one-call route
def test_sampled_output_follows_the_target(tmp_path, target_dir, target, kw, quantization):
    head, keep = _accepting_head(tmp_path, target_dir, target)
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    drafter = load_drafter(DraftSpec.create("eagle3", path=head, tree=tree, quantization=quantization), target)
    assert drafter.head.vocab.target_ids.tolist() == keep
    assert (drafter.head.native is not None) == (quantization == "int8" and native_layer.load() is not None)
    from runtime.decode import SpecDecoder

    dec = SpecDecoder(target, None, drafter, tree.num_nodes)
    stat, df, counts = distribution_stat(dec, target, PROMPTS[1], kw)
    assert stat < chi2_threshold(df), (stat, df)
    accepted = sum(dec.generate(PROMPTS[1], SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **kw))
                   .stats.accepted_tokens for s in range(40))
    assert accepted > 0  # drafts were accepted (and, with a random head, others rejected): both paths ran


def test_sampled_test_catches_lossy_acceptance(tmp_path, target_dir, target, monkeypatch):
    """Negative control: the same statistic rejects a lossy acceptance rule with this drafter."""
    import runtime.decode as decode_mod
    from runtime.decode import SpecDecoder

    monkeypatch.setattr(decode_mod, "verify", lossy_verify)
    head, _ = _accepting_head(tmp_path, target_dir, target)
    tree = Tree.from_choices([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    dec = SpecDecoder(target, None, load_drafter(DraftSpec.create("eagle3", path=head, tree=tree), target),
                      tree.num_nodes)
    stat, df, _ = distribution_stat(dec, target, PROMPTS[1], dict(temperature=1.0, top_k=4))
    assert stat > chi2_threshold(df), (stat, df)


# ---- bad head directories ----------------------------------------------------------------------------------------


def _edit_config(head: Path, **changes) -> None:
    cfg = json.loads((head / "config.json").read_text())
    cfg.update(changes)
    (head / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes,match", [
    ({"num_hidden_layers": 2}, r"num_hidden_layers: got 2, expected 1"),
    ({"target_hidden_size": 128}, r"target_hidden_size 128 does not match the target model's hidden_size 64"),
    ({"draft_vocab_size": 100}, r"draft_vocab_size 100 but d2t .* maps 420 draft tokens"),
    ({"fc_norm": True}, r"fc_norm: got True"),
    ({"eagle_config": {"eh_proj_before_attn": True}}, r"eagle_config.eh_proj_before_attn: got True"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, r"eagle_aux_hidden_state_layer_ids: got \[1, 2\], expected 3"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}, r"eagle_aux_hidden_state_layer_ids \(as layer inputs\): got "
                                                       r"\(1, 2, 9\), expected .* \[0, 8\]"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 6], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}},
     r"name other layers: inputs \[2, 4, 7\]"),
    ({"bias": "yes"}, r"bias must be true or false, got 'yes'"),
    ({"hidden_size": 32}, r"hidden_size 32 does not match the target model's hidden_size 64"),
])
def test_bad_configs_name_the_field(tmp_path, target_dir, target, changes, match):
    head = write_eagle3_head(tmp_path / "h", target_dir)
    _edit_config(head, **changes)
    with pytest.raises(CheckpointError, match=match):
        load_eagle3_head(head, target)


@pytest.mark.parametrize("hook,match", [
    (lambda st: {k: v for k, v in st.items() if k != "fc.weight"}, r"has no fc.weight: not an EAGLE-3 head"),
    (lambda st: {**st, "fc.weight": st["fc.weight"][:, :128].contiguous()},
     r"fc.weight has shape \(64, 128\), expected \[64, 192\]"),
    (lambda st: {**st, "lm_head.weight": st["lm_head.weight"][:100]}, r"lm_head.weight has 100 rows, expected 420"),
    (lambda st: {k: v for k, v in st.items() if k != "midlayer.hidden_norm.weight"},
     r"missing 1 key\(s\) \['midlayer.hidden_norm.weight'\]"),
    (lambda st: {**st, "midlayer.extra.weight": torch.zeros(2)}, r"unexpected 1 key\(s\) \['midlayer.extra.weight'\]"),
    (lambda st: {**st, "midlayer.self_attn.q_proj.weight": st["midlayer.self_attn.q_proj.weight"][:, :64].contiguous()},
     r"midlayer.self_attn.q_proj.weight has shape \(64, 64\), expected \(64, 128\)"),
    (lambda st: {**st, "d2t": st["d2t"].float()}, r"d2t must be a 1-D integer tensor"),
])
def test_bad_weights_name_the_tensor(tmp_path, target_dir, target, hook, match):
    head = write_eagle3_head(tmp_path / "h", target_dir, state_hook=hook)
    with pytest.raises(CheckpointError, match=match):
        load_eagle3_head(head, target)


def test_feature_layers_in_each_engines_meaning():
    assert default_feature_layers(32) == (2, 16, 29) and default_feature_layers(30) == (2, 15, 27)
    assert feature_layers({}, 32, "c") == (2, 16, 29)
    assert feature_layers({"eagle_aux_hidden_state_layer_ids": [29, 2, 16]}, 32, "c") == (2, 16, 29)  # vLLM: inputs
    assert feature_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}}, 32, "c") == (2, 16, 29)
    both = {"eagle_aux_hidden_state_layer_ids": [2, 16, 29], "eagle_config": {"eagle_aux_hidden_state_layer_ids":
                                                                                [1, 15, 28]}}
    assert feature_layers(both, 32, "c") == (2, 16, 29)
    with pytest.raises(CheckpointError, match=r"missing, and the default layers .* this 4-layer target"):
        feature_layers({}, 4, "c")
    assert feature_layers({"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}, 2, "c") == (0, 1, 2)


def test_an_eagle3_directory_given_as_eagle1_names_its_kind(tmp_path, target_dir, target, head_dir):
    with pytest.raises(CheckpointError, match=r"drafter kind 'eagle3' recognizes this directory"):
        load_drafter(DraftSpec.create("eagle", path=head_dir, tree="chain-2"), target)
    eagle1 = write_eagle_head(tmp_path / "e1", target_dir)
    from runtime.api import infer_draft_kind

    assert infer_draft_kind(head_dir) == "eagle3" and infer_draft_kind(eagle1) == "eagle"
    unnamed = write_eagle3_head(tmp_path / "u", target_dir, config_overrides={"architectures": ["LlamaForCausalLM"]})
    assert infer_draft_kind(unnamed) == "eagle3"  # the EAGLE repository's own training config names no EAGLE-3 class


def test_a_small_target_needs_named_layers(tmp_path):
    small = make_checkpoint(tmp_path / "t2", "llama3", seed=1)  # two layers: no default feature layers
    model = TargetModel.from_pretrained(small)
    head = write_eagle3_head(tmp_path / "h", small)
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids: missing"):
        load_eagle3_head(head, model)
    _edit_config(head, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    spec = runtime.load(small, draft_model=head, tree="chain-2")
    plain = runtime.load(small)
    assert spec.drafter.feature_layers == (0, 1, 2)
    assert spec.generate(PROMPTS[0], max_tokens=12, ignore_eos=True).token_ids == \
        plain.generate(PROMPTS[0], max_tokens=12, ignore_eos=True).token_ids
