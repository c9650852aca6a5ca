#!/usr/bin/env bash
# The main job: the router service with its embedded demo (mock engines and a gentle client) unless
# workers are given. Makes .venv exactly as tools/test.sh does when it is missing, installs the project
# with its `dev` and `anchors` extras, then runs `kvrouter up` with this script's arguments, e.g.
#   bash tools/up.sh                         # 4 mock engines, a client, a status line every 5 s
#   bash tools/up.sh --workers 1=tcp://127.0.0.1:5557 --block-size 16
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[dev,anchors]'
exec .venv/bin/kvrouter up "$@"
