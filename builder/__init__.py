"""spectree builder: one YAML config -> a self-contained engine directory (format: runtime/engine.py).

    python -m builder build --config configs/X.yaml [--output DIR] [--force]
    python -m builder validate --config configs/X.yaml
    python -m builder inspect ENGINE_DIR

    from builder.config import load_config
    from builder.build import build_engine
    result = build_engine(load_config("configs/X.yaml"))

Submodules are imported on use; importing `builder` itself does nothing.
"""
