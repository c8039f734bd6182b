#!/usr/bin/env bash
# The demo's custom Job: runs once per member, says hello, and leaves a file in
# $TUNEPLANE_OUT_DIR (the one directory that survives the Job).
set -euo pipefail

echo "hello from experiment hello on $(hostname)"
echo "working directory: $(pwd)"
echo "outputs go to: ${TUNEPLANE_OUT_DIR}"
printf 'hello from %s at %s\n' "$(hostname)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
    > "${TUNEPLANE_OUT_DIR}/hello.txt"
echo "wrote ${TUNEPLANE_OUT_DIR}/hello.txt; done"
