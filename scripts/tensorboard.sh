#!/usr/bin/env bash
# Serve a run's TensorBoard on 127.0.0.1 (loopback only; from another machine: ssh -L 6006:127.0.0.1:6006 host).
#
#   scripts/tensorboard.sh [dump_folder] [port] [extra tensorboard flags...]
#
# dump_folder defaults to outputs/llama3_debug (the debug config's [job] dump_folder); its tb/ folder (or the
# folder itself if it has none) is the log directory, each run a subfolder. port defaults to
# $TENSORBOARD_PORT, else 6006. The server runs in the foreground (exec: its PID is this script's); Ctrl-C
# stops it.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dump_folder="${1:-outputs/llama3_debug}"
port="${2:-${TENSORBOARD_PORT:-6006}}"
shift $(( $# < 2 ? $# : 2 ))

if [[ ! -d "$dump_folder" ]]; then
    echo "error: dump folder '$dump_folder' does not exist; give a run's [job] dump_folder (train first)" >&2
    exit 2
fi
if ! [[ "$port" =~ ^[0-9]+$ ]] || (( port < 1 || port > 65535 )); then
    echo "error: port '$port' is not a number from 1 to 65535" >&2
    exit 2
fi
logdir="$dump_folder/tb"
[[ -d "$logdir" ]] || logdir="$dump_folder"

tensorboard="$repo/.venv/bin/tensorboard"
[[ -x "$tensorboard" ]] || tensorboard="$(command -v tensorboard || true)"
if [[ -z "$tensorboard" ]]; then
    echo "error: tensorboard is not installed; run scripts/setup.sh (or pip install tensorboard)" >&2
    exit 2
fi

echo "TensorBoard for $logdir at http://127.0.0.1:$port/" >&2
exec "$tensorboard" --logdir "$logdir" --host 127.0.0.1 --port "$port" "$@"
