"""How often a cheaper 0.5B would agree with the 1.5B, before anyone builds it: teacher-forced greedy agreement
of draft variants that the engine does not ship (weights in other formats, layers skipped), against the 1.5B's
own greedy outputs, with the bytes each variant would read a token.

    python benchmarks/drafts/agreement.py                          # HumanEval, 8 prompts x 96 tokens
    python benchmarks/drafts/agreement.py --dataset sharegpt --skip-up-to 4

The 1.5B (GGUF, native kernels) decodes each prompt greedily. Each variant of the 0.5B then reads prompt + output
in one forward and predicts every output token from the target's prefix; agreement is the share it gets right,
through the draft's head over its first `--head-vocab` ids as the engine drafts. That is the per-token acceptance
of a greedy chain whose draft never stops early (the engine's p_min stops where the draft doubts, so its judged
tokens agree somewhat more often).

- Formats: the shipped Q4_0 requantization (native kernels) as the control, then the GGUF's own weights as dense
  fp32, and each decoder layer's linear weights rounded to nearest in 32-weight blocks: symmetric (a scale a block,
  as Q4_0) or with a minimum (a scale and a minimum, as Q4_1), at 2-4 bits; at 4 bits the rounding is gguf's own
  Q4_0 / Q4_1 bit for bit (tests/bench/test_agreement.py). These rows multiply fp32 activations, where the native
  kernels quantize activations to 8 bits, so the simulated Q4_0 row against the native one shows what that costs.
- Layers: from the native Q4_0 model, decoder layers are dropped one at a time, each time the one whose loss hurts
  agreement least on separate selection prompts (the first and last layers always stay); agreement is then read
  on the evaluation prompts.

Bytes: the variant's decoder-layer weights plus a Q4_0 head over `--head-vocab` ids, over the bytes the 1.5B reads a
decode step (`specfleet.bench.roofline.weight_bytes_per_step`: its decoder layers and its output head, 979 MB; not
its file's 1,117 MB, which also hold the embedding table a step reads one row of). This is a floor on d from
bandwidth alone at equal bandwidth; a step also pays calls, attention and norms, and prompt feeds.
"""
from __future__ import annotations

import argparse
import time

import torch

from specfleet.bench.report import md_table, write_results

# bits a weight of each simulated format: 32 weights of `bits` plus an fp16 scale (and an fp16 minimum)
FORMATS = {"q4_0": (4, True), "q4_1": (4, False), "q3_0": (3, True), "q3_1": (3, False), "q2_1": (2, False)}


def bits_per_weight(bits: int, symmetric: bool) -> float:
    return bits + (16 if symmetric else 32) / 32


def fake_quantize(w: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """`w` [out, in] rounded to nearest in 32-weight blocks along `in`, back in w's dtype, as ggml's reference
    quantizers do it at 4 bits (Q4_0 symmetric: the scale is the signed extreme over -2^(bits-1); Q4_1: a scale
    and a minimum): fp32 arithmetic, quants from the fp32 scale, values from the stored fp16 scale (and minimum)."""
    out, k = w.shape
    if k % 32:
        raise ValueError(f"rows of {k} weights are not whole 32-weight blocks")
    b = w.reshape(out, k // 32, 32).float()
    if symmetric:
        half = 2 ** (bits - 1)
        d = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True)) / -half
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = (b * inv + (half + 0.5)).trunc().clamp(max=2 * half - 1) - half
        r = q * d.half().float()
    else:
        lo, hi = b.min(-1, keepdim=True).values, b.max(-1, keepdim=True).values
        d = (hi - lo) / (2 ** bits - 1)
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        q = ((b - lo) * inv + 0.5).trunc().clamp(max=2 ** bits - 1)
        r = q * d.half().float() + lo.half().float()
    return r.reshape(out, k).to(w.dtype)


def agreement(model, items: list[tuple[list[int], list[int]]], head_vocab: int) -> float:
    from specfleet.runtime.kv.cache import KVCache
    from specfleet.runtime.step.runner import ForwardItem, ModelRunner

    block = 16
    blocks = (max(len(p) + len(o) for p, o in items) + block - 1) // block
    kv = KVCache.allocate(model.config, blocks, block, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, torch.device("cpu"), vocab_limit=head_vocab)
    hits = total = 0
    for prompt, out in items:
        seq = prompt + out
        logits = runner.execute([ForwardItem("a", seq, 0, list(range(len(prompt) - 1, len(seq) - 1)),
                                             block_ids=list(range(blocks)))])
        hits += sum(int(a == b) for a, b in zip(logits.argmax(-1).tolist(), out))
        total += len(out)
    return hits / total


def layer_weights(config) -> int:
    """The weights of a Llama/Qwen model's decoder-layer products: q, k, v, o, gate, up and down."""
    h, kv = config.hidden_size, config.num_kv_heads * config.head_dim
    return config.num_layers * (h * (config.num_heads * config.head_dim) * 2 + 2 * h * kv + 3 * h * config.intermediate_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--prompts", type=int, default=8, help="evaluation prompts")
    ap.add_argument("--select", type=int, default=12, help="selection prompts for the layers to drop (held out)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--head-vocab", type=int, default=65536, help="the draft's head over its first ids (the default)")
    ap.add_argument("--formats", default="q4_0,q4_1,q3_0,q3_1,q2_1")
    ap.add_argument("--skip-up-to", type=int, default=6, help="layers dropped at most")
    args = ap.parse_args()

    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.bench.roofline import weight_bytes_per_step
    from specfleet.llm import LLM
    from specfleet.runtime.loading import load
    from specfleet.sampling_params import SamplingParams
    from specfleet.strategies.factory import layer_cut

    src, _ = iter_prompts(args.dataset)
    texts = [p.text for p in select(src, args.prompts + args.select)]
    t0 = time.perf_counter()
    target = LLM("qwen-1.5b", draft=None)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    items = []
    for text in texts:
        ids = target.tokenizer.encode(text)
        items.append((ids, list(target.generate([ids], params)[0].token_ids)))
    evaluate, selection = items[:args.prompts], items[args.prompts:]
    target_bytes = weight_bytes_per_step(target.model)
    del target
    print(f"target outputs: {len(items)} prompts in {time.perf_counter() - t0:.0f} s", flush=True)

    def load_draft(quantization):
        return load.load_model("qwen-0.5b", torch.float32, torch.device("cpu"), with_tokenizer=False,
                               quantization=quantization)[0]

    native = load_draft("q4_0")
    hidden, weights = native.config.hidden_size, layer_weights(native.config)
    head_bytes = args.head_vocab * hidden * 4.5 / 8

    def floor(bpw: float, kept: float = 1.0) -> float:
        return round((weights * kept * bpw / 8 + head_bytes) / target_bytes, 3)

    formats = [{"variant": "Q4_0, native kernels (the shipped draft: control)", "bits/weight": 4.5,
                "agreement": round(agreement(native, evaluate, args.head_vocab), 3), "d floor": floor(4.5)}]
    print(formats[-1], flush=True)
    for name in ["source"] + [f for f in args.formats.split(",") if f]:
        model = load_draft(None)  # the GGUF's own weights, dense fp32
        if name == "source":
            bpw, label = None, "the GGUF's weights (Q5_0/Q8_0), dense fp32"
        else:
            bits, symmetric = FORMATS[name]
            bpw = bits_per_weight(bits, symmetric)
            label = f"{name}: {bits} bits, 32-weight blocks, {'a scale' if symmetric else 'a scale and a minimum'}"
            with torch.no_grad():
                for layer in model.layers:
                    for m in layer.modules():
                        if isinstance(m, torch.nn.Linear):
                            m.weight.copy_(fake_quantize(m.weight, bits, symmetric))
        formats.append({"variant": label, "bits/weight": bpw, "agreement": round(agreement(model, evaluate,
                        args.head_vocab), 3), "d floor": None if bpw is None else floor(bpw)})
        print(formats[-1], flush=True)
        del model

    total_layers = native.config.num_layers
    keep = list(range(total_layers))
    layers = [{"layers dropped": 0, "dropped": "", "agreement (selection)": round(agreement(native, selection,
               args.head_vocab), 3), "agreement": formats[0]["agreement"], "d floor": floor(4.5)}]
    for n in range(1, args.skip_up_to + 1):
        tried = [(agreement(layer_cut(native, [j for j in keep if j != i]), selection, args.head_vocab), i)
                 for i in keep[1:-1]]
        best, drop = max(tried)
        keep = [j for j in keep if j != drop]
        layers.append({"layers dropped": n, "dropped": drop, "agreement (selection)": round(best, 3),
                       "agreement": round(agreement(layer_cut(native, keep), evaluate, args.head_vocab), 3),
                       "d floor": floor(4.5, len(keep) / total_layers)})
        print(layers[-1], flush=True)

    print(md_table(formats, list(formats[0])))
    print(md_table(layers, list(layers[0])))
    p = formats[0]["agreement"]
    body = (f"Draft qwen-0.5b against target qwen-1.5b's greedy outputs, teacher-forced, {args.dataset}, "
            f"{args.prompts} evaluation prompts x {args.tokens} tokens ({args.select} more to choose the layers to "
            f"drop), head over the first {args.head_vocab} ids. Agreement: the share of the target's tokens the draft "
            "predicts from the target's prefix (per-token acceptance without early stops). d floor: the variant's "
            f"layer weights plus a Q4_0 head, over the {target_bytes / 1e6:.0f} MB the target reads a decode step. "
            "The simulated formats multiply fp32 "
            f"activations (the native kernels: 8-bit); one standard error of an agreement is about "
            f"{(p * (1 - p) / (args.prompts * args.tokens)) ** 0.5:.3f}.\n\n**Weight formats** (all layers)\n\n"
            + md_table(formats, list(formats[0])) + "\n\n**Layers dropped** (Q4_0, native kernels; each time the "
            "layer whose loss hurts agreement least on the selection prompts)\n\n" + md_table(layers, list(layers[0])))
    print(write_results("agreement", {"args": vars(args), "target_bytes": target_bytes, "formats": formats,
                                      "layers": layers, "kept_layers": keep}, body, dtype="gguf"))


if __name__ == "__main__":
    main()
