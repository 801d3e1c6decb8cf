"""Training tools: the demo target (`builder.train_target`), draft heads (`builder.train_heads`).

    config.py   frozen dataclasses for the training YAML (`load_train_config`), parsed like the build config
    corpus.py   text corpora (the standard library's own source by default), the fixed file-level held-out split,
                byte-level BPE training, token caches and batch sampling
    loop.py     what the training loops share: learning-rate schedule, time/step budget, resumable checkpoints,
                progress bar and the JSON-lines training log

torch and `transformers` (the reference Llama implementation, a tooling dependency) are imported by the loops,
not at package import.
"""
