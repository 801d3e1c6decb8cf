"""Triton model repositories for spectree engines.

    python -m model_repo render --engine ENGINE_DIR --output REPO_DIR [options]

`render` (model_repo.render) writes the repository from typed config (model_repo.model_config, written by
model_repo.pbtxt). What the served models run, by concern: `contract` (every input and output), `request`
(reading and validating a request), `responses`, `generations` (in-flight batching on one scheduler per
instance), `metrics`, `bls` (the ensemble model's calls: cancellation, error hand-over), `settings` (config.pbtxt
parameters), `engines` (what they read from the engine directory) and `errors`. `triton_adapter` is the only
module that imports triton_python_backend_utils (inside the server's python stub).
"""
