# Run from the repository root (after `python -m builder import-gguf --output models/smollm2-135m-instruct`).
# Greedy answers (transformers, bf16, batched) for the head-selection and merge-tuning prompts: held-out text.
import sys; sys.path.insert(0, '.')
import torch; torch.set_num_threads(2)
from builder.training.distill import generate, GenerateSettings
from runtime.prompts import load_prompt_file
ps = load_prompt_file('demo/smollm2/prompts/head-selection.jsonl') + load_prompt_file('demo/smollm2/prompts/merge-tuning.jsonl')
generate('models/smollm2-135m-instruct', [(p.key, p.text) for p in ps], 'out/s29-heldout',
         GenerateSettings(max_new_tokens=256, batch_size=38, answers=1))
