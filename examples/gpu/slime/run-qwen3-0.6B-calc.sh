#!/usr/bin/env bash
# GRPO with slime on one GPU, its rollouts unmodified agents in Docker sandboxes through trajproxy
# (integrations/slime.py): Qwen3-0.6B, trajproxy's `minimal` agent, the example task examples/tasks/calc.
# Written for a machine with a GPU, slime's image (Megatron-LM and SGLang installed) and a Docker engine; it cannot
# run on a CPU. See docs/trainers/slime.md.
#
# Before it:
#   MODEL_DIR   the model's Hugging Face folder (default /root/models/Qwen3-0.6B), and beside it
#               ${MODEL_DIR}_torch_dist, made by slime's tools/convert_hf_to_torch_dist.py
#   SLIME_DIR   a checkout of THUDM/slime at the commit .ci/trainers/slime.txt pins (default /root/slime)
#   trajproxy   this checkout, installed: pip install -e "$TRAJPROXY_DIR[served]"
#   the task's image: docker build -t trajproxy/example-calc examples/tasks/calc
# In a container, give it the engine's socket (-v /var/run/docker.sock:/var/run/docker.sock) and the host's /tmp at
# the same path (-v /tmp:/tmp): each sandbox's gate mounts the folder of trajproxy's Unix socket, made under /tmp.
set -euo pipefail

TRAJPROXY_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
SLIME_DIR=${SLIME_DIR:-/root/slime}
MODEL_DIR=${MODEL_DIR:-/root/models/Qwen3-0.6B}
RUN_DIR=${RUN_DIR:-/tmp/trajproxy-slime-calc}
mkdir -p "$RUN_DIR"

# The prompts are slime's JSONL as it is (prompt, label, metadata.image/workdir/eval_cmd): each row is its own
# task. Eight copies of the one example task make a batch.
for _ in 1 2 3 4 5 6 7 8; do cat "$TRAJPROXY_DIR/examples/tasks/calc/tasks.jsonl"; done >"$RUN_DIR/tasks.jsonl"

source "$SLIME_DIR/scripts/models/qwen3-0.6B.sh"  # MODEL_ARGS: the architecture, as slime's scripts give it

CKPT_ARGS=(
  --hf-checkpoint "$MODEL_DIR"
  --ref-load "${MODEL_DIR}_torch_dist"
  --load "$RUN_DIR/ckpt"
  --save "$RUN_DIR/ckpt"
  --save-interval 1000
)

ROLLOUT_ARGS=(
  --custom-generate-function-path integrations.slime.generate
  --custom-reward-post-process-path integrations.slime_groups.post_process_rewards  # GRPO groups of episodes
  --dynamic-sampling-filter-path integrations.slime_groups.drop_aborted_groups  # groups with a lost episode dropped
  --prompt-data "$RUN_DIR/tasks.jsonl"
  --input-key prompt
  --label-key label
  --metadata-key metadata
  --num-rollout 4
  --rollout-batch-size 2
  --n-samples-per-prompt 4
  --rollout-max-response-len 512
  --rollout-temperature 1.0
  --global-batch-size 8
  --rollout-shuffle
)

GRPO_ARGS=(
  --advantage-estimator grpo
  --use-kl-loss
  --kl-loss-coef 0.0
  --kl-loss-type low_var_kl
  --entropy-coef 0.0
  --eps-clip 0.2
  --eps-clip-high 0.28
  --use-tis  # the rollout's own logprobs, recorded per sampled token, correct the training-inference mismatch
)

OPTIMIZER_ARGS=(
  --optimizer adam
  --lr 1e-6
  --lr-decay-style constant
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
)

PERF_ARGS=(
  --tensor-model-parallel-size 1
  --pipeline-model-parallel-size 1
  --context-parallel-size 1
  --use-dynamic-batch-size
  --max-tokens-per-gpu 8192
)

SGLANG_ARGS=(
  --rollout-num-gpus-per-engine 1
  --sglang-mem-fraction-static 0.5
  --router-policy consistent_hashing  # one episode's calls to one engine (X-SMG-Routing-Key), for its prefix cache
)

MISC_ARGS=(
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
  --attention-backend flash
)

# trajproxy's settings reach slime's rollout actor through Ray's runtime environment
RUNTIME_ENV_JSON=$(python3 - <<PY
import json
print(json.dumps({"env_vars": {
    "PYTHONPATH": "/root/Megatron-LM/:$TRAJPROXY_DIR",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "TRAJPROXY_SLIME_AGENT": "minimal",
    "TRAJPROXY_SLIME_DATABASE_URL": "sqlite:///$RUN_DIR/episodes.db",
    "TRAJPROXY_SLIME_TOOL_PARSER": "hermes",
    "TRAJPROXY_SLIME_AGENT_TIMEOUT_S": "600",
}}))
PY
)

export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
ray start --head --node-ip-address "$MASTER_ADDR" --num-gpus 1 --disable-usage-stats
trap 'ray stop --force' EXIT

cd "$SLIME_DIR"
ray job submit --address="http://127.0.0.1:8265" --runtime-env-json="$RUNTIME_ENV_JSON" -- \
  python3 train.py \
  --actor-num-nodes 1 \
  --actor-num-gpus-per-node 1 \
  --colocate \
  "${MODEL_ARGS[@]}" \
  "${CKPT_ARGS[@]}" \
  "${ROLLOUT_ARGS[@]}" \
  "${GRPO_ARGS[@]}" \
  "${OPTIMIZER_ARGS[@]}" \
  "${PERF_ARGS[@]}" \
  "${SGLANG_ARGS[@]}" \
  "${MISC_ARGS[@]}"

# Every episode stays in $RUN_DIR/episodes.db: `trajproxy export --database-url sqlite:///$RUN_DIR/episodes.db`.
