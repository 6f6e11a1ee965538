#!/usr/bin/env bash
# saccade on several machines under SLURM: one `saccade launch` per node, each told its place in
# the config's [launch] layout (--node-rank) and the nodes' addresses (--hosts, in the layout's
# order). The run folder (log.dir) must be on a filesystem every node shares: the trainer writes
# the weights the servers load there. docs/launch.md, "Several machines".
#
#   sbatch --nodes 2 scripts/slurm-launch.sh my-run.toml [--section.key VALUE ...]
#
#SBATCH --job-name=saccade
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
set -euo pipefail
config=${1:?usage: sbatch --nodes N scripts/slurm-launch.sh CONFIG [overrides]}
shift
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)
# The servers listen beyond loopback, so they want a key; one for the whole job.
export VLLM_API_KEY=${VLLM_API_KEY:-$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')}
# SLURM_NODEID is this node's place in the job's node list, the order of --hosts.
srun --kill-on-bad-exit=1 bash -c \
    'exec saccade launch "$0" --hosts "$1" --node-rank "$SLURM_NODEID" "${@:2}"' "$config" "$hosts" "$@"
