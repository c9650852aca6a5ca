#!/usr/bin/env bash
# The full drills of `kvrouter replay` (docs/replay.md), where the test suite runs only their short forms:
# every drill at its defaults (400 requests of the packaged sample at x4; the NATS drills on a nats-server
# the run starts), then, with --soak, every drill again on the sample's 2,000 requests at x4 (five times
# the default's load, about five times as long).
# Each run's table, JSON (drills.json / soak.json) and plot (drills.png / soak.png) go to DIR (default
# drills-<date>), and a replay of the default run's recording (recording.kvr) must match every decision.
# Exit status: the first failing run's (1: a drill did not converge or account for its gaps).
#   bash tools/drills.sh [--soak] [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
soak=0
if [ "${1:-}" = "--soak" ]; then
    soak=1
    shift
fi
out="${1:-drills-$(date -u +%Y%m%dT%H%M%S)}"
mkdir -p "$out"
kvrouter=.venv/bin/kvrouter
[ -x "$kvrouter" ] || { echo "no .venv: run bash tools/test.sh once first" >&2; exit 2; }
echo "== every drill at its defaults -> $out/drills.json"
"$kvrouter" replay --drill all --json "$out/drills.json" --plot "$out/drills.png" --record "$out/recording.kvr"
echo "== the default run's recording replayed in logical time -> $out/recording.json"
"$kvrouter" replay --from "$out/recording.kvr" --json "$out/recording.json"
if [ "$soak" = 1 ]; then
    echo "== soak: every drill on 2,000 requests at x4 -> $out/soak.json"
    "$kvrouter" replay --drill all --requests 2000 --speed 4 --json "$out/soak.json" --plot "$out/soak.png"
fi
