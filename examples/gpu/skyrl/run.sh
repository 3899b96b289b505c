#!/usr/bin/env bash
# A few GRPO steps of SkyRL (skyrl[fsdp] 0.4, Python 3.12, on a GPU node, Docker running) with trajproxy's generator: the minimal
# agent on the calc example task in sandboxes, 4 rollouts a step, Qwen3-0.6B from a local folder.
#
#   MODEL_DIR=/models/Qwen3-0.6B bash examples/gpu/skyrl/run.sh [more SkyRL overrides]
#
# It has not been run here (no GPU machine was lent to the task that wrote it); what it needs: SkyRL installed with its
# GPU extras (`pip install 'skyrl[fsdp]>=0.4'` on Python 3.12), trajproxy's checkout on PYTHONPATH with its
# dependencies and the `served` extra (`pip install -e '.[served]'`), Docker, and the example's image
# (`docker build -t trajproxy/example-calc examples/tasks/calc`).
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL_DIR="${MODEL_DIR:?the folder of the policy, e.g. Qwen3-0.6B}"
DATA="${DATA:-$HOME/data/trajproxy}"
RUN="${RUN:-trajproxy-calc}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

python examples/gpu/skyrl/prepare_dataset.py examples/tasks/calc/tasks.jsonl --out "$DATA/train.jsonl" --repeat 8

python -m examples.gpu.skyrl.main_trajproxy \
  data.train_data="['$DATA/train.jsonl']" \
  data.val_data=null \
  trainer.policy.model.path="$MODEL_DIR" \
  trainer.run_name="$RUN" \
  trainer.project_name=trajproxy \
  trainer.logger=console \
  trainer.strategy=fsdp \
  trainer.placement.colocate_all=true \
  trainer.placement.policy_num_gpus_per_node=1 \
  trainer.placement.ref_num_gpus_per_node=1 \
  trainer.algorithm.advantage_estimator=grpo \
  trainer.algorithm.use_kl_loss=false \
  trainer.algorithm.max_seq_len=8192 \
  trainer.epochs=1 \
  trainer.train_batch_size=2 \
  trainer.policy_mini_batch_size=2 \
  trainer.micro_forward_batch_size_per_gpu=1 \
  trainer.micro_train_batch_size_per_gpu=1 \
  trainer.eval_interval=-1 \
  trainer.eval_before_train=false \
  trainer.ckpt_interval=-1 \
  trainer.hf_save_interval=-1 \
  trainer.export_path="$DATA/exports" \
  trainer.ckpt_path="$DATA/ckpts" \
  trainer.policy.optimizer_config.lr=1.0e-6 \
  generator.n_samples_per_prompt=2 \
  generator.batched=false \
  generator.step_wise_trajectories=true \
  generator.sampling_params.max_generate_length=1024 \
  generator.inference_engine.backend=vllm \
  generator.inference_engine.run_engines_locally=true \
  generator.inference_engine.num_engines=1 \
  generator.inference_engine.tensor_parallel_size=1 \
  generator.inference_engine.served_model_name=policy \
  generator.inference_engine.gpu_memory_utilization=0.5 \
  generator.inference_engine.engine_init_kwargs.max_model_len=8192 \
  trajproxy.agent=minimal \
  trajproxy.database_url="sqlite:///$DATA/$RUN.db" \
  trajproxy.max_concurrency=8 \
  trajproxy.chat_template_kwargs='{enable_thinking: false}' \
  "$@"
