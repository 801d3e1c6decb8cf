"""Triton model repositories for spectree engines.

    python -m model_repo render --engine ENGINE_DIR --output REPO_DIR [options]

`render` (model_repo.render) writes the repository from typed config (model_repo.schema, written by
model_repo.pbtxt); `pipeline` holds the request handling the served models run; `triton_adapter` is the only
module that imports triton_python_backend_utils (inside the server's python stub).
"""
