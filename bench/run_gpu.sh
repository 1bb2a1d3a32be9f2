#!/usr/bin/env bash
# The GPU session in one script (what produced bench/results/): GPU tests and the three
# benchmarks on a 2 x H200 machine without DeepSpeed installed (it travels as wheels in .whl/).
#   bash bench/run_gpu.sh [sections...]      sections: tests_native rollout sync tests_sync train
#                                            v4attn (one H200: V4 attention test + benchmark)
#                                            v4layer (one H200, .whl with transformers 5.19: two
#                                            V4-Flash layers fwd+bwd, eager vs project vs fused
#                                            path; V4_LAYER_ARGS adds options)
#                                            tests_v4 (the V4 BF16 GPU tests: HF and fused
#                                            layer under DeepSpeed ZeRO-2/3, the HF engine)
#                                            tests_v4layer (the fused V4 layer's GPU test, same
#                                            machine; its own call: with v4layer it can pass
#                                            one call's 600 s)
#                                            moe_actor (2 H200: V4-shaped actor, EP=2 vs ZeRO-3;
#                                            MOE_ACTOR_ARGS="--ep 2 --profile" adds a profile)
#                                            moe_actor_1gpu (one GPU: the same actor step under
#                                            ZeRO-2, 32 experts: DeepSpeed's own cost)
#                                            export (one GPU, .whl with deepspeed: launch.export
#                                            in both formats on a real ZeRO-3 checkpoint of two
#                                            V4-Flash layers, vs a plain copy and zero_to_fp32;
#                                            EXPORT_ARGS replaces "--experts auto --budget-s 480")
#                                            packing (one GPU: the trainer's forward + backward,
#                                            padded vs packed micro-batches, demo and long-tail
#                                            length mixes, Qwen3-0.6B dims; PACKING_ARGS adds
#                                            options)
#                                            lmhead (one GPU: V4-Flash's LM head fwd+bwd, full
#                                            logits vs the chunked path at 512 / 1,024 / 2,048
#                                            rows a chunk; LM_HEAD_ARGS replaces those options)
#                                            v4attn_layers (one GPU: the HCA and sliding-only V4
#                                            attention layers' Triton fwd+bwd, into $OUT/hca
#                                            and $OUT/sliding)
#   (fp8gemm: the decode GEMMs, FP8 paths vs BF16 vs the roofline; issue 16's measurement;
#    fp8gemm_sweep: the same with w8a16's launch settings swept per shape)
#   (decode_profile: bench/decode_profile.py alone, single-pass attention)
#   (decode_attention: the decode attention kernel alone, BF16 vs FP8 KV over its settings)
#   (sampling: the per-step sampler alone, ours vs the torch paths vs the logits read once)
#   (r3: routing replay, native FP8 engine vs BF16 trainer model; not in the default list)
#   (colocated: one H200 holds the trainer and the engine, no sync.backend override (auto takes
#    CUDA IPC): the Qwen3-MoE demo's 250 steps -> gpu_learn_colocated.{json,md};
#    tests_colocated: its GPU test, one step and two syncs over CUDA IPC)
#   (tests_sync_only: the sync test without the RL step)
#   (profile: where a decode step's time goes, bench/decode_profile.py, single-pass vs split-K
#    decode attention; ncu on each attention kernel; bench/rollout.py's dense rows with both
#    kernels into $OUT/decode_attention/)
#   (v4_learn: one H200, .whl with transformers 5.19: the V4 BF16 GPU tests, then the tiny V4
#    demo learning on the GPU: BF16 DeepSpeed trainer + HF engine on the same device, into
#    gpu_learn_v4.{json,md}; V4_LEARN_ARGS adds overrides)
#   (topology: issue 17's Slurm hetjob on GPU nodes, bench/topology_gpu.py; carry .whl, .ray
#    (bench/ray_slim.sh) and .debs (slurm/testing/fetch_debs.sh))
#   (v4attn_tests, v4attn_bench: v4attn's two halves, for one call each when both together
#    could pass a call's 600 s)
# Writes into $OUT (default bench/results): run.log, gpu_report.jsonl, <bench>.json / .md.
# Each section has its own time limit, so one hang cannot eat the others. GPU tests run with
# RL_GPU_STRICT=1 (a skipped GPU test fails: no missing dependency passes as green) and the
# script exits non-zero when any section failed (its last line names them).
set -u
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
LOG="$OUT/run.log"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 RL_GPU_STRICT=1
export GPU_REPORT="$OUT/gpu_report.jsonl"
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import deepspeed" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl >>"$LOG" 2>&1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
if [ -f .ray/ray_slim.tar.xz ] && ! python3 -c "import ray" 2>/dev/null; then
    # the slim Ray of bench/ray_slim.sh, and the small wheels beside it (submitit, jsonschema)
    mkdir -p /tmp/site && tar -xJf .ray/ray_slim.tar.xz -C /tmp/site >>"$LOG" 2>&1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .ray/*.whl >>"$LOG" 2>&1
    export PYTHONPATH=/tmp/site:$PWD
fi
sections=${*:-tests_native rollout sync tests_sync train}

failed=()
run() {  # run NAME LIMIT_S CMD...
    local name=$1 limit=$2 rc
    shift 2
    echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
    [ "$rc" = 0 ] || failed+=("$name")
}

{ nvidia-smi -L; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton',
triton.__version__, 'gpus', torch.cuda.device_count())"; } >>"$LOG" 2>&1
for s in $sections; do
    case $s in
        tests_native) run tests_native 200 python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_native_gpu.py tests/rl/quant/test_fp8_gpu.py ;;
        rollout) run rollout 400 python3 -m bench.rollout --out "$OUT" ;;
        sync) run weight_sync 90 python3 -m bench.weight_sync --out "$OUT" ;;
        tests_sync) run tests_sync 300 python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_sync_gpu.py tests/gpu/test_rl_step_gpu.py ;;
        tests_sync_only) run tests_sync_only 240 python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_sync_gpu.py ;;
        train) run train 75 python3 -m bench.train --out "$OUT" ;;
        v4attn) run tests_v4attn 260 python3 -m pytest -q -p no:cacheprovider -s \
                    tests/gpu/test_v4_attention_gpu.py
                run v4_attention 300 python3 -m bench.v4_attention --out "$OUT" ;;
        v4layer) run v4_layer 540 python3 -m bench.v4_layer --out "$OUT" ${V4_LAYER_ARGS:---profile} ;;
        export) run export 560 python3 -m bench.export --out "$OUT" \
                    ${EXPORT_ARGS:---experts auto --budget-s 480} ;;
        tests_v4) run tests_v4 300 python3 -m pytest -q -p no:cacheprovider \
                      tests/gpu/test_v4_bf16_gpu.py ;;
        tests_v4layer) run tests_v4layer 360 python3 -m pytest -q -p no:cacheprovider -s \
                           tests/gpu/test_v4_layer_gpu.py ;;
        moe_actor) run moe_actor 900 python3 -m bench.moe_actor --out "$OUT" ${MOE_ACTOR_ARGS:-} ;;
        # one GPU: the V4 actor step under DeepSpeed ZeRO-2 (no collectives), 32 experts so that
        # its optimizer state fits 80 GB; MOE_ACTOR_ARGS adds options (--profile)
        moe_actor_1gpu) run moe_actor_1gpu 560 python3 -m bench.moe_actor --out "$OUT" \
                            --ranks 1 --zero-stage 2 --ep 1 --experts 32 ${MOE_ACTOR_ARGS:-} ;;
        tests_packing) run tests_packing 200 python3 -m pytest -q -p no:cacheprovider -s \
                           tests/gpu/test_packing_gpu.py ;;
        packing) run tests_packing 200 python3 -m pytest -q -p no:cacheprovider \
                     tests/gpu/test_packing_gpu.py
                 run packing 420 python3 -m bench.packing --out "$OUT" ${PACKING_ARGS:-} ;;
        lmhead) run tests_lm_head 120 python3 -m pytest -q -p no:cacheprovider \
                    tests/gpu/test_lm_head_gpu.py
                run lm_head 300 python3 -m bench.lm_head --out "$OUT" \
                    ${LM_HEAD_ARGS:---chunk-rows 512 1024 2048} ;;
        fp8gemm) run fp8_gemm 240 python3 -m bench.fp8_gemm --out "$OUT" ;;
        fp8gemm_sweep) run fp8_gemm_sweep 420 python3 -m bench.fp8_gemm --sweep --out "$OUT" ;;
        decode_profile) run decode_profile 300 python3 -m bench.decode_profile --attention single \
                            --out "$OUT" ;;
        decode_attention) run decode_attention 240 python3 -m bench.decode_attention --out "$OUT" ;;
        sampling) run sampling 120 python3 -m bench.sampling --out "$OUT" ;;
        profile) run decode_profile 420 python3 -m bench.decode_profile --out "$OUT"
                 # each decode attention kernel alone (split: its split and combine kernels)
                 for attn in single split; do
                     run ncu_attention_$attn 240 ncu --kernel-name regex:_decode_attn \
                         --launch-skip 200 --launch-count 2 --section SpeedOfLight \
                         --section MemoryWorkloadAnalysis --section Occupancy \
                         --section LaunchStats -o "$OUT/ncu_attention_$attn" \
                         python3 -m bench.decode_profile --attention $attn --out /tmp/ncu_run
                 done
                 # old vs new decode attention end to end (own directory: bench/results/rollout.*
                 # stay the committed single-kernel run)
                 run rollout_attention 560 python3 -m bench.rollout --models dense \
                     --attention single,split --hf-max-new 0 --out "$OUT/decode_attention" ;;
        v4_learn) run tests_v4 240 python3 -m pytest -q -p no:cacheprovider \
                      tests/gpu/test_v4_bf16_gpu.py tests/gpu/test_v4_attention_gpu.py
                  ;&
        v4_learn_only)
                  # math-verify is not installed there: the exact reward, the same verdict on
                  # this task's integer answers
                  run gpu_learn_v4 480 python3 -m bench.async_rl --config configs/local_v4.yaml \
                      --name gpu_learn_v4 --staleness 0 --out "$OUT" --runs-dir /tmp/runs_v4 \
                      model.dtype=bfloat16 trainer.device=cuda trainer.num_ranks=1 \
                      rollout.engine=hf reward.function=exact \
                      ${V4_LEARN_ARGS:-} ;;
        topology) run topology 560 python3 -m bench.topology_gpu --out "$OUT" ;;
        v4attn_tests) run tests_v4attn 560 python3 -m pytest -q -p no:cacheprovider -s \
                          tests/gpu/test_v4_attention_gpu.py ;;
        v4attn_bench) run v4_attention 560 python3 -m bench.v4_attention --out "$OUT" ;;
        # the CSA layer with the Triton indexer against its torch scores, and its tests
        v4attn_csa) run tests_v4attn 300 python3 -m pytest -q -p no:cacheprovider -s \
                        tests/gpu/test_v4_attention_gpu.py
                    run v4_attention_csa 300 python3 -m bench.v4_attention --layer csa \
                        --impl triton triton_torch_indexer --core triton \
                        --tokens 4096 8192 18432 --out "$OUT/csa" ;;
        # the HCA and sliding-only layers' rates (the planner costs every layer at the CSA rate)
        v4attn_layers) for layer in hca sliding; do
                           run v4_attention_$layer 240 python3 -m bench.v4_attention \
                               --layer $layer --impl triton --core --tokens 4096 8192 18432 \
                               --out "$OUT/$layer"
                       done ;;
        r3) run routing_replay 240 python3 -m bench.routing_replay --out "$OUT" ;;
        tests_colocated) run tests_colocated 240 python3 -m pytest -q -p no:cacheprovider \
                             tests/gpu/test_colocated_gpu.py ;;
        # math-verify is not installed there: the exact reward, the same verdict on the demo's
        # integer answers. One trainer rank: two would need two GPUs.
        colocated) run gpu_learn_colocated 480 python3 -m bench.async_rl \
                       --config configs/local.yaml --name gpu_learn_colocated --staleness 0 \
                       --out "$OUT" --runs-dir /tmp/runs_colocated \
                       model.dtype=bfloat16 trainer.device=cuda trainer.num_ranks=1 \
                       rollout.engine=native reward.function=exact ${COLOCATED_ARGS:-} ;;
        *) echo "unknown section $s" | tee -a "$LOG"; failed+=("$s") ;;
    esac
done
grep -E "^(=== |FAILED|ERROR|[0-9]+ (passed|failed))" "$LOG" | tail -40
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED SECTIONS: ${failed[*]}"
    exit 1
fi
echo "all sections passed"
