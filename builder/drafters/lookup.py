"""Prompt lookup in the builder: TensorRT-LLM 1.2 decodes it as NGram (draft tokens from outside the engine, its
n-gram proposer in examples/run.py); nothing to write beyond the target."""

from __future__ import annotations

from builder.config import BuildPlan
from builder.drafters import BuilderKind
from runtime.drafters.lookup import NAME


class LookupBuild(BuilderKind):
    name = NAME
    # examples/ngram/run_dtm_ngram.py is orchestrator mode: it spreads the ranks over its device list itself
    trtllm_mpirun = False

    def trtllm_build_args(self, plan: BuildPlan) -> list[str]:
        return ["--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len",
                str(plan.config.build.max_draft_len), "--use_paged_context_fmha", "enable"]

    def trtllm_run_args(self, plan: BuildPlan) -> list[str]:
        # --ngram_config [max_draft_len, max_matching_ngram_size, device_list] (1.x; pre-1.0 --prompt_lookup_config);
        # the device list has one GPU per rank (examples/ngram/README.md), and run.py asserts
        # kv_cache_enable_block_reuse and not use_py_session for it.
        lk = plan.draft.lookup
        devices = ",".join(str(r) for r in range(plan.config.build.tp_size))
        return [f"--ngram_config=[{lk.num_draft_tokens},{lk.max_ngram},[{devices}]]", "--kv_cache_enable_block_reuse"]


KIND = LookupBuild()
