#!/bin/bash
# shardkit on a Cloud TPU VM slice: `TPU=my-pod ZONE=us-central2-b bash launch/tpu_vm.sh [--config.x=...]`.
# Runs the same command on every worker (--worker=all). JAX's GceTpuCluster detector finds the workers and this
# one's number through the TPU VM's metadata server (no variable to set): each prints `distributed: GceTpuCluster
# matched (...): process K of N`. The repository must be at ~/shardkit on every worker, and RUN_DIR a directory
# every worker shares (a Filestore or gcsfuse mount): the global checkpoints are written by all of them.
# Spot / preemptible TPUs get SIGTERM before they stop: every process checkpoints the same step and exits 143;
# rerun this script (or let a queued resource recreate the slice and rerun it) to resume.
set -eu
: "${TPU:?set TPU to the name of the TPU VM}" "${ZONE:?set ZONE}"
CONFIG=${CONFIG:-experiments/configs/gpt_1b.py}
RUN_DIR=${RUN_DIR:-/mnt/shared/runs}
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone="$ZONE" --worker=all --command \
  "cd ~/shardkit && python -m experiments.train --config=$CONFIG --config.distributed=True \
   --config.run_dir=$RUN_DIR --config.emergency_dir=/tmp/shardkit-emergency$args"
