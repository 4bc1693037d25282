#!/usr/bin/env bash
# Create .venv from a Python >= 3.12 (PATH first, then pyenv) and install jmamba with its test extras (and the optional hf, tensorboard ones, so their tests run).
# A rerun with an up-to-date venv does nothing (the stamp holds a hash of pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
STAMP="$VENV/.jmamba-installed"
want=$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

is_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }
find_python() {
    local c
    for c in "${PYTHON:-}" python3.12 python3.13 python3; do
        [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_ok "$(command -v "$c")" && { command -v "$c"; return; }
    done
    local root="${PYENV_ROOT:-$HOME/.pyenv}"
    for c in $(ls -d "$root"/versions/3.1[2-9]* 2>/dev/null | sort -V); do
        [ -x "$c/bin/python" ] && is_ok "$c/bin/python" && { echo "$c/bin/python"; return; }
    done
    return 1
}
PY=$(find_python) || { echo "bootstrap: need Python >= 3.12 on PATH or under pyenv (set PYTHON=...)" >&2; exit 1; }
echo "bootstrap: creating $VENV with $PY ($("$PY" --version))"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[test,plot,hf,tensorboard]"
echo "$want" > "$STAMP"
echo "bootstrap: done"
