"""Arguments shared by `specfleet generate` and `specfleet serve`, and the LLM they describe."""
from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from specfleet.llm import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL, help="registered model name, HF folder or .gguf file")
    p.add_argument("--draft", default="default",
                   help="draft spec: a model name/path (NAME@N keeps N layers), 'prompt-lookup', 'ngram', 'datastore', "
                        "'none', or a composition such as 'vote(qwen-0.5b,prompt-lookup)+adaptive' "
                        "(grammar in specfleet/strategies/spec_language.py); 'default' = the default draft of the "
                        "embedded 1.5B on this device (CPU: fleet(suffix,prompt-lookup,datastore,qwen-0.5b[quant=q4_0]), "
                        "without the 0.5B where it is not installed or the kernels run the AVX2 path; CUDA: "
                        "fleet(suffix,prompt-lookup)), none for any other target")
    p.add_argument("--num-speculative-tokens", "--spec-len", "-k", dest="num_speculative_tokens", type=int, default=4,
                   help="draft tokens per step (chain length / tree depth); k= in a draft spec")
    p.add_argument("--tree-width", type=int, default=1, help="children per tree node; 1 = chain")
    p.add_argument("--tree-nodes", type=int, default=16, help="node budget of a draft tree")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--quantization", default="auto",
                   choices=["auto", "gguf", "none", "int8", "q4_0", "q8_0", "q4_k"],
                   help="weights of target and draft models: auto (default) = gguf for a .gguf model on the CPU, "
                        "else none; gguf = keep the file's block formats (native kernels, fp32 activations, "
                        "--dtype unused); none = dense in --dtype; int8 = weight-only int8; q4_0/q8_0/q4_k = "
                        "requantize at load. Speculation is lossless against the target as loaded")
    p.add_argument("--kv-cache-mb", type=int, default=1024, help="memory for the target's KV cache, MiB")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="prefill every prompt from scratch instead of reusing the KV of earlier requests' "
                        "identical prefixes (on by default; hit rate in /metrics)")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens per engine step: decode/verify rows first, then chunks of waiting prompts")
    p.add_argument("--max-num-prefills", type=int, default=4, help="prompts prefilled side by side in one step")
    p.add_argument("--mixed-step-factor", type=_factor, default=2.0,
                   help="while other requests decode or wait, a step with prompt chunks costs about this many "
                        "decode steps (measured as it runs); 'none': only --max-num-batched-tokens bounds it")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=512,
                   help="new tokens at most (generation also stops at the model's end of turn)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_llm(args):
    from specfleet.llm import LLM, _USE_DEFAULT

    draft = _USE_DEFAULT if args.draft == "default" else args.draft
    return LLM(args.model, draft, dtype=args.dtype, device=args.device, num_speculative_tokens=args.num_speculative_tokens,
               top_children=args.tree_width, max_nodes=args.tree_nodes, kv_cache_bytes=args.kv_cache_mb << 20,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, max_num_prefills=args.max_num_prefills,
               mixed_step_factor=args.mixed_step_factor, enable_prefix_caching=args.prefix_caching,
               quantization=args.quantization)


def sampling_from_args(args):
    from specfleet.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          max_tokens=args.max_tokens, stop=args.stop)


def _factor(text: str) -> float | None:
    return None if text.strip().lower() == "none" else float(text)
