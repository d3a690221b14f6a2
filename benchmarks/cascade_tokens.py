"""Greedy tokens with and without cascade attention on prefix_cache.py's shared-prefix workload
(64 requests on one 1,000-token system prompt, 32 output tokens each), one engine each.

    python benchmarks/cascade_tokens.py --dtype float32 --dtype bfloat16

Per dtype: how many of the 64 outputs differ, and for each that does, the output position of
the first difference and the gap between the two most likely tokens there (log-probabilities
of the run without cascade): a gap near zero is a near-tie that any change in summation order
can flip.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(__file__))
from prefix_cache import ANSWER, _tokens


def outputs(dtype: str, cascade: bool, prompts: list[list[int]]) -> list[tuple[list[int], list[dict[int, float]]]]:
    from kvserve import LLM, SamplingParams

    llm = LLM("smollm2-135m", dtype=dtype, block_size=16, kv_cache_memory="4GiB", max_num_seqs=64,
              max_model_len=2048, disable_cascade_attn=not cascade)
    params = SamplingParams(temperature=0, max_tokens=ANSWER, ignore_eos=True, logprobs=2)
    return [(o.token_ids, o.top_logprobs or []) for o in llm.generate(prompts, params, use_tqdm=False)]


def compare(dtype: str) -> dict[str, object]:
    rng = random.Random(0)  # prefix_cache.shared_prefix's prompts
    system = _tokens(rng, 1000)
    prompts = [system + _tokens(rng, 50) for _ in range(64)]
    with_cascade = outputs(dtype, True, prompts)
    without = outputs(dtype, False, prompts)
    firsts = []
    for (ours, _), (ref, top) in zip(with_cascade, without, strict=True):
        if ours != ref:
            i = next(i for i, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
            best = sorted(top[i].values(), reverse=True)
            firsts.append({"position": i, "top2_gap": best[0] - best[1]})
    return {"dtype": dtype, "requests": len(prompts), "differ": len(firsts), "first_differences": firsts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", action="append", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    results = [compare(dtype) for dtype in args.dtype or ["float32", "bfloat16"]]
    for r in results:
        gaps = [f["top2_gap"] for f in r["first_differences"]]  # type: ignore[union-attr]
        print(f"{r['dtype']}: {r['differ']} of {r['requests']} outputs differ"
              + (f"; top-2 gap at the first difference: max {max(gaps):.3f}, median {sorted(gaps)[len(gaps) // 2]:.3f}"
                 if gaps else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
