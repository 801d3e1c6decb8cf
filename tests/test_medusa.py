"""Medusa-1 heads: FasterDecoding formats, head outputs vs the reference modules, tree candidate layout, errors."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.draft_spec import DraftSpec
from runtime.drafters import load_drafter
from runtime.drafters.medusa import MedusaDrafter, load_medusa_heads
from runtime.errors import CheckpointError, ConfigError
from runtime.model import TargetModel
from runtime.protocol import Proposal
from runtime.tree import Tree
from tests.heads import load_medusa_reference, write_medusa_head
from tests.tiny import make_checkpoint

H, V = 64, 420  # the tiny target's hidden and vocab sizes (checked in test_tiny_target_sizes)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("target"), "llama2")


@pytest.fixture(scope="module")
def target(target_dir):
    return TargetModel.from_pretrained(target_dir)


def test_tiny_target_sizes(target):
    assert (target.config.hidden_size, target.config.vocab_size) == (H, V)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
@pytest.mark.parametrize("num_layers", [0, 1, 2])
def test_heads_match_reference_modules(tmp_path, fmt, num_layers):
    path = write_medusa_head(tmp_path, H, V, num_heads=3, num_layers=num_layers, fmt=fmt, seed=num_layers)
    heads = load_medusa_heads(path)
    ref = load_medusa_reference(path)
    assert heads.config.num_heads == 3 and heads.config.num_layers == num_layers
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    ours = heads(x)  # [3, 5, V]
    assert ours.shape == (3, 5, V) and ours.dtype == torch.float32
    with torch.no_grad():
        expected = torch.stack([ref[i](x) for i in range(3)])
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # The first k heads alone give the same numbers.
    torch.testing.assert_close(heads(x, 2), expected[:2], rtol=1e-5, atol=1e-5)


def test_bfloat16_heads_load_in_requested_dtype(tmp_path):
    path = write_medusa_head(tmp_path, H, V, num_heads=2, dtype=torch.bfloat16)
    heads = load_medusa_heads(path, dtype=torch.float32)
    assert heads.lm_weight.dtype == torch.float32
    ref = load_medusa_reference(path)
    torch.testing.assert_close(heads.lm_weight[1], ref[1][-1].weight)
    assert load_medusa_heads(path).lm_weight.dtype == torch.bfloat16  # default: the file's dtype


def golden_candidates(head_logits: torch.Tensor, root: int, top_k: int = 10) -> torch.Tensor:
    """[root, head0 top-k, head1 top-k, ...] as Medusa's generate_candidates lays them out."""
    top = torch.topk(head_logits, top_k, dim=-1).indices  # [heads, top_k]
    return torch.cat([torch.tensor([root]), top.reshape(-1)])


def test_candidate_layout_equals_golden_tree_indices(tmp_path):
    path = write_medusa_head(tmp_path, H, V, num_heads=3, seed=3)
    heads = load_medusa_heads(path)
    tree = Tree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    hidden = torch.randn(7, H, generator=torch.Generator().manual_seed(2))
    session = MedusaDrafter(heads, tree).start(torch.arange(7), hidden, 64)
    draft = session.draft(17)
    assert draft.proposal is Proposal.DETERMINISTIC and draft.draft_probs is None
    ref = load_medusa_reference(path)
    with torch.no_grad():
        logits = torch.stack([ref[i](hidden[-1]) for i in range(3)])
    golden_tree_indices = torch.tensor([0, 1, 2, 11, 12, 11, 21])  # reference-facts section 1
    assert draft.tokens.tolist() == golden_candidates(logits, 17)[golden_tree_indices].tolist()
    assert draft.tokens[0] == 17


def test_mc_sim_7b_63_nodes_take_rank_r_token_of_head_d_minus_1(tmp_path):
    path = write_medusa_head(tmp_path, H, V, num_heads=4, seed=4)
    heads = load_medusa_heads(path)
    tree = Tree.preset("mc_sim_7b_63")
    hidden = torch.randn(3, H, generator=torch.Generator().manual_seed(5))
    draft = MedusaDrafter(heads, tree).start(torch.arange(3), hidden, 64).draft(5)
    assert draft.tree.num_nodes == 64
    ref = load_medusa_reference(path)
    with torch.no_grad():
        top = [torch.topk(ref[i](hidden[-1]), 10).indices for i in range(4)]
    depth, ranks = tree.depth.tolist(), tree.ranks.tolist()
    for i in range(1, tree.num_nodes):
        assert int(draft.tokens[i]) == int(top[depth[i] - 1][ranks[i]])


def test_session_follows_the_last_hidden_state(tmp_path):
    heads = load_medusa_heads(write_medusa_head(tmp_path, H, V, num_heads=2, seed=6))
    tree = Tree.chain(2)
    gen = torch.Generator().manual_seed(7)
    prompt_hidden, step_hidden = torch.randn(4, H, generator=gen), torch.randn(3, H, generator=gen)
    session = MedusaDrafter(heads, tree).start(torch.arange(4), prompt_hidden, 8)
    first = session.draft(1).tokens
    expected_first = torch.topk(heads(prompt_hidden[-1:]), 1, dim=-1).indices.reshape(-1)
    assert first[1:].tolist() == expected_first.tolist()
    session.advance(torch.tensor([1, 2, 3]), step_hidden)
    second = session.draft(9).tokens
    expected_second = torch.topk(heads(step_hidden[-1:]), 1, dim=-1).indices.reshape(-1)
    assert second.tolist() == [9] + expected_second.tolist()


@pytest.mark.parametrize("max_nodes", [1, 2, 11, 30])
def test_max_nodes_shrinks_to_an_ancestor_closed_prefix(tmp_path, max_nodes):
    heads = load_medusa_heads(write_medusa_head(tmp_path, H, V, num_heads=4))
    full = Tree.preset("mc_sim_7b_63")
    draft = MedusaDrafter(heads, full).start(torch.arange(2), torch.randn(2, H), max_nodes).draft(0)
    assert draft.tree.num_nodes == max_nodes
    assert set(draft.tree.choices) <= set(full.choices)
    for c in draft.tree.choices:  # Tree.from_choices already refuses orphans; check the prefix property directly
        assert len(c) == 1 or c[:-1] in draft.tree.choices


def test_load_drafter_medusa_default_tree(tmp_path, target):
    path = write_medusa_head(tmp_path / "m4", H, V, num_heads=4)
    drafter = load_drafter(DraftSpec.create("medusa", path=path), target)
    assert drafter.name == "medusa" and drafter.tree == Tree.preset("mc_sim_7b_63")
    path = write_medusa_head(tmp_path / "m2", H, V, num_heads=2)
    drafter = load_drafter(DraftSpec.create("medusa", path=path), target)
    assert drafter.tree == Tree.chain(2)
    drafter = load_drafter(DraftSpec.create("medusa", path=path, tree=[[0], [1], [0, 0]]), target)
    assert drafter.tree.num_nodes == 4


# ---- errors ------------------------------------------------------------------------------------------------


def test_tree_deeper_than_heads(tmp_path):
    heads = load_medusa_heads(write_medusa_head(tmp_path, H, V, num_heads=2))
    with pytest.raises(ConfigError, match=r"tree depth 3 exceeds the 2 Medusa heads"):
        MedusaDrafter(heads, Tree.chain(3))


def test_hidden_and_vocab_mismatch_with_target(tmp_path, target):
    path = write_medusa_head(tmp_path / "h", 32, V, num_heads=2)
    with pytest.raises(CheckpointError, match=r"hidden size 32 .* hidden_size 64"):
        load_drafter(DraftSpec.create("medusa", path=path), target)
    path = write_medusa_head(tmp_path / "v", H, 400, num_heads=2)
    with pytest.raises(CheckpointError, match=r"vocab size 400 .* vocab_size 420"):
        load_drafter(DraftSpec.create("medusa", path=path), target)


def test_missing_files(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        load_medusa_heads(tmp_path / "nope")
    path = write_medusa_head(tmp_path / "a", H, V)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_medusa_heads(path)
    path = write_medusa_head(tmp_path / "b", H, V)
    (path / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither medusa_lm_head.safetensors nor medusa_lm_head.pt"):
        load_medusa_heads(path)


def test_missing_and_extra_keys(tmp_path):
    def drop(state):
        state.pop("1.0.linear.bias")
        return state

    with pytest.raises(CheckpointError, match=r"missing 1 key\(s\) \['1.0.linear.bias'\]"):
        load_medusa_heads(write_medusa_head(tmp_path / "a", H, V, state_hook=drop))

    def add(state):
        state["4.1.weight"] = torch.zeros(V, H)
        return state

    with pytest.raises(CheckpointError, match=r"unexpected 1 key\(s\) \['4.1.weight'\]"):
        load_medusa_heads(write_medusa_head(tmp_path / "b", H, V, num_heads=4, state_hook=add))
    # Config says 3 heads, file has 4: the 4th head's keys are unexpected.
    path = write_medusa_head(tmp_path / "c", H, V, num_heads=4, config_overrides={"medusa_num_heads": 3})
    with pytest.raises(CheckpointError, match="medusa_num_heads=3.*unexpected 3 key"):
        load_medusa_heads(path)


def test_bad_shapes_and_config(tmp_path):
    def wrong_shape(state):
        state["1.0.linear.weight"] = torch.zeros(H, H + 1)
        return state

    with pytest.raises(CheckpointError, match=r"1.0.linear.weight has shape \(64, 65\), expected \(64, 64\)"):
        load_medusa_heads(write_medusa_head(tmp_path / "a", H, V, state_hook=wrong_shape))
    path = write_medusa_head(tmp_path / "b", H, V, config_overrides={"medusa_num_layers": None})
    with pytest.raises(CheckpointError, match="lacks 'medusa_num_layers'"):
        load_medusa_heads(path)
    path = write_medusa_head(tmp_path / "c", H, V, config_overrides={"medusa_num_heads": 0})
    with pytest.raises(CheckpointError, match="medusa_num_heads must be an integer >= 1, got 0"):
        load_medusa_heads(path)
    path = write_medusa_head(tmp_path / "d", H, V, config_overrides={"hidden_size": 128})
    with pytest.raises(CheckpointError, match="hidden_size=128 but the weights .* have 64"):
        load_medusa_heads(path)
    path = write_medusa_head(tmp_path / "e", H, V)
    (path / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError, match="cannot read .*config.json"):
        load_medusa_heads(path)


def test_pt_file_must_be_a_plain_state_dict(tmp_path):
    path = write_medusa_head(tmp_path, H, V, fmt="pt")
    torch.save({"heads": {"0.1.weight": torch.zeros(V, H)}, "step": 3}, path / "medusa_lm_head.pt")
    with pytest.raises(CheckpointError, match="state dict of tensors"):
        load_medusa_heads(path)
    (path / "medusa_lm_head.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read Medusa weights"):
        load_medusa_heads(path)


def test_config_json_written_is_fasterdecoding_style(tmp_path):
    cfg = json.loads((write_medusa_head(tmp_path, H, V, num_heads=5) / "config.json").read_text())
    assert cfg["medusa_num_heads"] == 5 and cfg["medusa_num_layers"] == 1
