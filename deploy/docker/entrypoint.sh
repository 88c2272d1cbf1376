#!/bin/sh
# Container entry point: `corral serve` with any extra flags given as the container command.
# A checkpoint mounted at /model (compose mounts CORRAL_MODEL_DIR there, read-only) is served when present;
# otherwise the embedded default model. An explicit CORRAL_MODEL or --model wins.
set -e
if [ -z "${CORRAL_MODEL:-}" ] && [ -f /model/config.json ]; then
    export CORRAL_MODEL=/model
fi
if [ -z "${CORRAL_MODEL:-}" ]; then
    unset CORRAL_MODEL  # an empty value would read as the current directory
fi
exec corral serve "$@"
