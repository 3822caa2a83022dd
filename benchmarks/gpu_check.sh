#!/usr/bin/env bash
# The GPU checks of the FedSEPT issue, as one script (a GPU machine is lent only to some sessions):
#   1. fedsept_efficiency.py at ViT-B/16 size on the GPU, in this process;
#   2. the same benchmark in 4 Ray actors sharing the GPU (0.25 GPU each, as execution.client_gpus=0.25 does);
#   3. a FedSEPT federation (ViT-B-16, random weights, synthetic data at 224 px) with 4 client actors on
#      0.25 GPU each, both routers;
#   0. first, the text-tower fast paths (gpu_paths.py: s/step of PromptFL and FedSEPT at ViT-B-16 size, random
#      weights, under fp32 / bf16 / fp16 autocast / torch.compile / DP-SGD microbatch 8 and auto) and the DP-SGD
#      cost beside its FLOP bound (dp_cost.py), each under its own time limit so a slow one cannot eat the rest.
# Usage: OUT=folder bash benchmarks/gpu_check.sh   (about 5 + 6 minutes on one H200; needs the project's venv)
#        PATHS_ONLY=1 runs step 0 alone (about 6 minutes).
set -euo pipefail
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
timeout 300 python benchmarks/gpu_paths.py --device cuda --model ViT-B-16 --pretrained "" --methods promptfl,fedsept \
  --classes 10 --batch 32 --n-ctx 16 --steps 5 --repeats 3 | tee "$OUT/gpu_paths.md" || echo "gpu_paths.py failed or ran past 300 s" | tee -a "$OUT/gpu_paths.md"
timeout 120 python benchmarks/dp_cost.py --device cuda --model ViT-B-16 --pretrained "" --batch 32 --n-ctx 16 \
  --microbatch 0 | tee "$OUT/dp_cost.md" || echo "dp_cost.py failed or ran past 120 s" | tee -a "$OUT/dp_cost.md"
if [ -n "${PATHS_ONLY:-}" ]; then exit 0; fi
python benchmarks/fedsept_efficiency.py --device cuda --classes 10 --batch 32 | tee "$OUT/efficiency_cuda.md"
python benchmarks/fedsept_efficiency.py --actors 4 --actor-gpus 0.25 --classes 10 --batch 32 | tee "$OUT/efficiency_4actors.md"
for router in pooled patch; do
  python raysim/run.py method=fedsept model.name=ViT-B-16 model.pretrained= data.dataset=synthetic execution.device=cuda execution.backend=ray \
    execution.num_actors=4 execution.client_gpus=0.25 train.rounds=3 eval.every=3 output.progress=false output.tensorboard=false \
    fedsept.router=$router output.cache_dir="$OUT/cache" output.out_dir="$OUT/run-$router" | tee "$OUT/run-$router.md"
  cp "$OUT/run-$router/results.csv" "$OUT/results-$router.csv"
done
