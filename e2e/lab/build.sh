#!/usr/bin/env bash
# Build the lab's binaries, or reuse them from ~/.cache/finetune-operator/lab/<key>/.
# For .ci/run: a cold build takes tens of minutes on 2 cores, a warm call about a second.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec python3 -m e2e.lab build "$@"
