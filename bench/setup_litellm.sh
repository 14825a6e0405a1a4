#!/usr/bin/env bash
# LiteLLM's proxy in a venv of its own (.litellm-venv at the repository's root, ignored by git), for
# bench/litellm_vs_engy.py: its dependencies never touch the project's .venv. Not under bench/:
# tests/test_docs.py reads every file there.
# prisma is LiteLLM's database client, needed only for `--litellm-db postgres` (virtual keys
# with budgets); it downloads Prisma's engines from Prisma's own host on first use.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="$(dirname "$here")/.litellm-venv"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --upgrade pip
"$venv/bin/pip" install --quiet 'litellm[proxy]' prisma
"$venv/bin/litellm" --version
