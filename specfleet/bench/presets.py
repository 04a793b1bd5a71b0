"""Named benchmark presets. A preset is one or more parts (a target model, a prompt set, batch sizes
and systems each) plus the claims the issues make, checked as ratios in the report.

Every option of `specfleet bench` overrides the matching field in every part of a preset, so
`specfleet bench spec --num-prompts 2 --max-tokens 8` is a quick smoke run of the same setup.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from specfleet.errors import SpecfleetError

QWEN_15B, QWEN_05B = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class RunConfig:
    name: str = "custom"
    model: str = QWEN_15B
    systems: tuple[str, ...] = ("specfleet:none", "specfleet:qwen-0.5b", "hf", "hf-assisted:qwen-0.5b")
    dataset: str = "humaneval"
    num_prompts: int = 8
    shuffle_seed: int | None = None  # None: the first prompts in file order
    max_prompt_tokens: int = 1024
    chat: str = "auto"  # auto (the dataset's default) | on | off
    batch_sizes: tuple[int, ...] = (1,)
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    dtype: str = "bfloat16"
    device: str = "cpu"
    spec_len: int = 4
    kv_cache_mb: int | None = None
    quantization: str | None = None  # "int8": every specfleet system's target and drafts (runtime/formats/quant.py)
    baseline: str | None = None  # speed-ups are against this system; default: the first specfleet:none
    # > 1: run every system this many times over all prompts, alternating the order (A B C, C B A, ...),
    # and report all rounds together, so a machine that slows down or speeds up during the run (shared
    # hosts do, by 20 % and more within an hour) affects every system alike instead of the first or last
    rounds: int = 1
    # measure each system's prefill tok/s at 128/512 tokens, c(k) for k=1..8 and resident memory after its
    # warm-up (bench/gguf_micro.py), once per round
    micro: bool = False
    # after its timed waves, replay every row of this many prompts per specfleet system (untimed) as plain
    # decode steps (bench/rowcheck.py), so a figure never comes from a run whose rows broke losslessness
    rowcheck_prompts: int = 0
    # build every system afresh for each batch size (its own warm-up), so a draft that remembers past outputs
    # (suffix decoding's shared trie) or a prefix cache cannot replay the earlier batch size's run of the same prompts
    fresh_per_batch: bool = False
    # an editor's, chat's or agent's loop: before each timed prompt (batch 1) what the earlier requests of its loop
    # leave in a server's cache (the dataset's Prompt.previous: the conversation up to the new turn or tool result,
    # or the same file under another edit) goes to the same system untimed, for one new token, so the context they
    # share sits in the system's prefix cache (specfleet's prefix cache, llama-server's cache_prompt); the timed
    # request is then what the loop's next turn costs
    loop: bool = False


@dataclass(frozen=True)
class Check:
    """A claim: metric(system a at batch a) / metric(system b at batch b) >= min_ratio, in one part; with
    `at_most`, a value instead: metric(system a) <= at_most (b unused). A metric "micro:<name>" is the median
    over rounds of the system's bench/gguf_micro.py figure (prefill_128_tok_s, c(2), ...)."""

    label: str
    part: str
    a: tuple[str, int]
    b: tuple[str, int]
    metric: str
    min_ratio: float
    at_most: float | None = None


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    runs: tuple[RunConfig, ...]
    checks: tuple[Check, ...] = ()
    expected_duration: str = ""

    def with_overrides(self, **overrides) -> "Preset":
        fields = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, runs=tuple(replace(r, **fields) for r in self.runs))


def _decode_part(name: str, model: str) -> RunConfig:
    return RunConfig(name=name, model=model, systems=("specfleet:none", "hf"), dataset="humaneval", num_prompts=8,
                     batch_sizes=(1, 8), max_tokens=32, ignore_eos=True)


def _decode_checks(part: str, size: str) -> tuple[Check, ...]:
    return (Check(f"{size} single-request decode tok/s: specfleet >= transformers", part, ("specfleet:none", 1),
                  ("hf", 1), "decode_throughput_tok_s", 1.0),
            Check(f"{size} aggregate decode tok/s: 8 concurrent >= 4x one", part, ("specfleet:none", 8),
                  ("specfleet:none", 1), "decode_throughput_tok_s", 4.0))


_Q8 = ",quantization=int8"
_DRAFTS3 = "qwen-0.5b,qwen-0.5b@12,prompt-lookup"
# every strategy against the same autoregressive baseline, batch 1 (the ablation in the style
# of Minions' Figure 10 is the chain single draft -> +vote -> +adaptive -> +tree/staged rows)
# the 0.5B voting with the weightless drafts only (no second model to run), with adaptive length
_VOTE_FREE = "specfleet:vote(qwen-0.5b,prompt-lookup,ngram)+adaptive[max_length=8]"

_STRATEGIES = (
    "specfleet:none",
    # the heterogeneous draft set, one at a time (with the 0.5B depth sweep)
    "specfleet:qwen-0.5b", "specfleet:qwen-0.5b@18", "specfleet:qwen-0.5b@12", "specfleet:qwen-0.5b@6",
    "specfleet:prompt-lookup", "specfleet:ngram", "specfleet:qwen-0.5b+ngram",
    # fixed speculation lengths against the adaptive controller (k=4 is the single-draft row)
    "specfleet:qwen-0.5b,k=1", "specfleet:qwen-0.5b,k=2", "specfleet:qwen-0.5b,k=6", "specfleet:qwen-0.5b,k=8",
    "specfleet:qwen-0.5b+adaptive[max_length=8]",
    # chain against best-first tree
    "specfleet:qwen-0.5b[width=2,nodes=12]",
    # Minions voting, then the ablation steps on top of it
    f"specfleet:vote({_DRAFTS3})", f"specfleet:vote({_DRAFTS3})+adaptive[max_length=8]",
    "specfleet:vote(qwen-0.5b[width=2,nodes=12],qwen-0.5b@12,prompt-lookup)+adaptive[max_length=8]", _VOTE_FREE,
    # SPIN selection against its baselines
    f"specfleet:select({_DRAFTS3})", f"specfleet:select[policy=epsilon-greedy]({_DRAFTS3})",
    f"specfleet:select[policy=prompt-length]({_DRAFTS3})",
)

# the ShareGPT part keeps one row per mechanism (the full list takes about an hour a part here)
_STRATEGIES_SHORT = (
    "specfleet:none", "specfleet:qwen-0.5b", "specfleet:prompt-lookup", "specfleet:qwen-0.5b,k=1",
    "specfleet:qwen-0.5b+adaptive[max_length=8]", "specfleet:qwen-0.5b[width=2,nodes=12]",
    f"specfleet:vote({_DRAFTS3})", f"specfleet:vote({_DRAFTS3})+adaptive[max_length=8]", _VOTE_FREE,
    f"specfleet:select({_DRAFTS3})", f"specfleet:select[policy=epsilon-greedy]({_DRAFTS3})",
    f"specfleet:select[policy=prompt-length]({_DRAFTS3})",
)

# the GGUF file as it is (native block-format kernels), the same file dequantized to bf16, and
# llama.cpp on the same file; the part's quantization "gguf" is the native system's
_GGUF_SYSTEMS = ("specfleet:none", "specfleet:none,quantization=none", "llamacpp")


def _gguf_part(name: str, model: str, dataset: str) -> RunConfig:
    return RunConfig(name=name, model=model, systems=_GGUF_SYSTEMS, dataset=dataset, num_prompts=4,
                     shuffle_seed=0 if dataset == "sharegpt" else None, max_prompt_tokens=160, max_tokens=32,
                     batch_sizes=(1,), ignore_eos=True, quantization="gguf", micro=dataset == "humaneval",
                     rowcheck_prompts=2)


def _gguf_checks(part: str, size: str, target: float, micro: bool = False) -> tuple[Check, ...]:
    """Native plain decode >= 1.0x llama.cpp on every part; where the part measures them, prefill >= 0.9x
    llama.cpp and (the 1.5B) c(2) <= 1.25, c(4) <= 1.6 (1.2 on a VNNI path), c(8) <= 2.2."""
    nat = ("specfleet:none", 1)
    checks = (Check(f"{size} {part.split('-')[0]} decode tok/s: specfleet native >= {target}x llama.cpp", part, nat,
                    ("llamacpp", 1), "decode_throughput_tok_s", target),
              Check(f"{size} decode tok/s: native vs dense bf16 (reported)", part, nat,
                    ("specfleet:none,quantization=none", 1), "decode_throughput_tok_s", 0.0))
    if micro:
        checks += (Check(f"{size} prefill (128 tokens): specfleet native >= 0.9x llama.cpp", part, nat, ("llamacpp", 1),
                         "micro:prefill_128_tok_s", 0.9),)
    if micro and size == "1.5B":
        # verification rows nearly free: steady-state c(k) ceilings, tighter where the kernels have VNNI
        vnni = _kernel_path() in ("avxvnni", "avx512vnni", "amx")
        c4 = 1.2 if vnni else 1.6
        checks += (Check("1.5B verification cost c(2) <= 1.25", part, nat, nat, "micro:c(2)", 0.0, at_most=1.25),
                   Check(f"1.5B verification cost c(4) <= {c4} ({'VNNI' if vnni else 'AVX2'} path)", part, nat, nat,
                         "micro:c(4)", 0.0, at_most=c4),
                   Check("1.5B verification cost c(8) <= 2.2", part, nat, nat, "micro:c(8)", 0.0, at_most=2.2))
    return checks


def _kernel_path() -> str | None:
    """The ISA path the native kernels take here (None where they cannot run)."""
    try:
        from specfleet.runtime.backends.native import kernels as native_backend

        return native_backend.isa()
    except (ImportError, ValueError):
        return None


# the default fleet (the CPU default draft of LLM()) against each single draft and plain decoding,
# everything on the GGUF files as they are (native kernels), llama.cpp's plain decoding on the same file as
# the outside baseline, and beside them the fleet that also holds the draft model and the n-gram model
FLEET = "fleet(suffix,prompt-lookup,datastore,qwen-0.5b[quant=q4_0])"  # = specfleet.llm.DEFAULT_DRAFT["cpu"] (tests/bench/test_metrics.py)
WEIGHTLESS_FLEET = "fleet(suffix,prompt-lookup,datastore)"  # the CPU default where the 0.5B is not installed
FLEET_WITH_MODEL = "fleet(qwen-0.5b,suffix,prompt-lookup,ngram)"
_FLEET_MEMBERS = ("specfleet:qwen-0.5b", "specfleet:qwen-0.5b[quant=q4_0]", "specfleet:suffix",
                  "specfleet:prompt-lookup")
_FLEET_SYSTEMS = ("specfleet:none", f"specfleet:{FLEET}", f"specfleet:{WEIGHTLESS_FLEET}", f"specfleet:{FLEET_WITH_MODEL}",
                  *_FLEET_MEMBERS)


def _fleet_part(name: str, dataset: str, temperature: float) -> RunConfig:
    greedy = temperature == 0.0
    return RunConfig(name=name, systems=_FLEET_SYSTEMS + (("llamacpp",) if greedy else ()), dataset=dataset,
                     num_prompts=10, shuffle_seed=0 if dataset == "sharegpt" else None, max_prompt_tokens=512,
                     max_tokens=96, temperature=temperature, top_p=1.0 if greedy else 0.9,
                     batch_sizes=(1,), quantization="gguf", rounds=2, rowcheck_prompts=2)


# drafts from other model families (through text) beside the same-vocabulary ones, and SPIN's
# selector over all of them against its best member
_CROSS_SELECT = "select(qwen-0.5b,smollm2-135m-instruct,gemma-3-270m,suffix,prompt-lookup)"
_CROSS_SYSTEMS = ("specfleet:none", "specfleet:smollm2-135m-instruct", "specfleet:gemma-3-270m", "specfleet:qwen-0.5b",
                  "specfleet:suffix", "specfleet:prompt-lookup", f"specfleet:{_CROSS_SELECT}")


def _cross_part() -> RunConfig:
    return RunConfig(name="humaneval-cross", systems=_CROSS_SYSTEMS, dataset="humaneval", num_prompts=10,
                     max_prompt_tokens=512, max_tokens=96, batch_sizes=(1,), quantization="gguf", rounds=2)


def _cross_checks() -> tuple[Check, ...]:
    return tuple(Check(f"humaneval-cross: the selector vs {m.split(':', 1)[1]} (reported)", "humaneval-cross",
                       (f"specfleet:{_CROSS_SELECT}", 1), (m, 1), "throughput_tok_s", 0.0)
                 for m in _CROSS_SYSTEMS[:-1])


# the fleet at 1, 4 and 8 concurrent streams (waves of that many requests decoding together): speculation must
# never cost more than it gains at any batch size, so the default fleet (which holds the 0.5B) and the weightless
# fleet (the default where the 0.5B is not installed) are each held to >= 0.97x plain decoding at every batch size
STREAMS = (1, 4, 8)


def _streams_part() -> RunConfig:
    return RunConfig(name="humaneval-streams", systems=("specfleet:none", f"specfleet:{FLEET}",
                                                        f"specfleet:{WEIGHTLESS_FLEET}"),
                     dataset="humaneval", num_prompts=8, max_prompt_tokens=512, max_tokens=96, batch_sizes=STREAMS,
                     quantization="gguf", rounds=2, fresh_per_batch=True)


def _streams_checks() -> tuple[Check, ...]:
    return tuple(Check(f"humaneval-streams: {fleet} >= 0.97x plain at {b} streams", "humaneval-streams",
                       (f"specfleet:{fleet}", b), ("specfleet:none", b), "throughput_tok_s", 0.97)
                 for fleet in (FLEET, WEIGHTLESS_FLEET) for b in STREAMS)


def _fleet_checks(part: str, floor: float) -> tuple[Check, ...]:
    fleet = (f"specfleet:{FLEET}", 1)
    checks = [Check(f"{part}: the fleet >= {floor}x native autoregressive", part, fleet, ("specfleet:none", 1),
                    "throughput_tok_s", floor)]
    checks += [Check(f"{part}: the fleet vs the single draft {m.split(':', 1)[1]} (never below 0.97x)", part, fleet,
                     (m, 1), "throughput_tok_s", 0.97) for m in _FLEET_MEMBERS]
    checks += [Check(f"{part}: the fleet vs {other} (reported)", part, fleet, (f"specfleet:{other}", 1),
                     "throughput_tok_s", 0.0) for other in (WEIGHTLESS_FLEET, FLEET_WITH_MODEL)]
    return tuple(checks)


_ALL = ("specfleet:none", "specfleet:qwen-0.5b", "specfleet:prompt-lookup", "hf", "hf-assisted:qwen-0.5b")

# the workloads where users meet speculation, each on data that others wrote (bench/datasets.py):
# specfleet's plain decoding and its default speculation for the model (the CPU default draft, FLEET) on the same
# prompts, beside llama-server's speculation in its own process with its defaults (`--spec-type ngram-mod`, and
# `draft-simple` with the 0.5B GGUF as `-md`); the 1.5B GGUF as it is, greedy, batch 1, two rounds in alternating
# order; speculative outputs compared with plain ones per prompt (the report's "= AR out")
LLAMA_NGRAM, LLAMA_DRAFT = "llamacpp:ngram-mod", "llamacpp:draft-simple,draft_model=qwen-0.5b"
_WORKLOAD_SYSTEMS = ("specfleet:none", f"specfleet:{FLEET}", LLAMA_NGRAM, LLAMA_DRAFT)
# part -> (dataset, prompts, max prompt tokens, max new tokens, shuffle seed, the floor over plain)
WORKLOADS = {
    # a whole file in, the edited file out (capped at 512); in file order, whose first four hold all three edits
    "code-edit": ("code-edit", 4, 1600, 512, None, 2.5),
    "chat": ("sharegpt-multiturn", 4, 1024, 128, 0, 1.3),  # a later ShareGPT turn, earlier turns as context
    "tool-loop": ("tool-loop", 4, 1536, 64, 0, 0.0),  # BFCL: call, result, ..., the next call
    "humaneval": ("humaneval", 4, 512, 128, None, 1.5),  # fresh code (raw completion prompt)
}


# the same prompts as loops meet them (RunConfig.loop): each right after what the earlier requests of its editor
# session, chat or agent loop leave in the server's cache (the same file under another edit; the conversation up to
# the new user turn or tool result, whose earlier answers and calls a server that made them keeps as KV)
WARM = "-warm"
LOOP_WORKLOADS = ("code-edit", "chat", "tool-loop")


def _workload_part(name: str) -> RunConfig:
    base = name.removesuffix(WARM)
    dataset, num, max_prompt, max_tokens, seed, _ = WORKLOADS[base]
    return RunConfig(name=name, systems=_WORKLOAD_SYSTEMS, dataset=dataset, num_prompts=num, shuffle_seed=seed,
                     max_prompt_tokens=max_prompt, max_tokens=max_tokens, batch_sizes=(1,), quantization="gguf",
                     rounds=2, loop=name.endswith(WARM))


def _workload_checks(name: str) -> tuple[Check, ...]:
    floor = WORKLOADS[name.removesuffix(WARM)][-1]
    fleet, plain = (f"specfleet:{FLEET}", 1), ("specfleet:none", 1)
    label = f">= {floor}x specfleet plain decoding" if floor else "vs specfleet plain decoding (reported)"
    return (Check(f"{name}: default speculation {label}", name, fleet, plain,
                  "throughput_tok_s", floor),
            Check(f"{name}: default speculation vs plain, decode tok/s (reported)", name, fleet, plain,
                  "decode_throughput_tok_s", 0.0),
            Check(f"{name}: default speculation >= 1.5x llama-server ngram-mod", name, fleet, (LLAMA_NGRAM, 1),
                  "throughput_tok_s", 1.5),
            Check(f"{name}: default speculation >= 1.5x llama-server draft-simple (0.5B)", name, fleet,
                  (LLAMA_DRAFT, 1), "throughput_tok_s", 1.5))


_WORKLOAD_PARTS = (*WORKLOADS, *(n + WARM for n in LOOP_WORKLOADS))

PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", "smoke test: SmolLM2-135M, 2 HumanEval prompts, 8 tokens, fp32",
           (RunConfig(name="tiny", model="smollm2-135m-instruct", dataset="humaneval", num_prompts=2,
                      systems=("specfleet:none", "specfleet:prompt-lookup", "hf", "hf-assisted:prompt-lookup"),
                      batch_sizes=(1, 2), max_tokens=8, dtype="float32"),),
           expected_duration="under a minute"),
    Preset("fleet-small", "a fleet against each of its drafts alone and plain decoding on SmolLM2-135M in fp32: its "
           "first 8 layers as a draft model, prompt lookup, the n-gram model and fleet() of the three; 4 HumanEval "
           "prompts, 48 new tokens (EOS ignored), greedy, batch 1, two rounds in alternating order; the report "
           "shows what the fleet measured and chose",
           (RunConfig(name="humaneval", model="smollm2-135m-instruct", dataset="humaneval", num_prompts=4,
                      systems=("specfleet:none", "specfleet:smollm2-135m-instruct@8", "specfleet:prompt-lookup",
                               "specfleet:ngram", "specfleet:fleet(smollm2-135m-instruct@8,prompt-lookup,ngram)"),
                      max_tokens=48, ignore_eos=True, dtype="float32", rounds=2),),
           expected_duration="about 3 minutes on 2 CPU cores"),
    Preset("decode", "single-request decode tok/s, specfleet vs transformers.generate, 0.5B and 1.5B "
           "in bf16 (8 HumanEval prompts, 32 tokens each, EOS ignored), and 8 concurrent requests vs 1",
           (_decode_part("qwen-0.5b", QWEN_05B), _decode_part("qwen-1.5b", QWEN_15B)),
           _decode_checks("qwen-0.5b", "0.5B") + _decode_checks("qwen-1.5b", "1.5B"),
           expected_duration="about 10-12 minutes on 2 CPU cores"),
    Preset("spec", "1.5B target + 0.5B draft, greedy, bf16, the first 20 HumanEval prompts, 64 new "
           "tokens, batch 1 (specfleet spec vs transformers assisted vs specfleet AR), then batch 4 and 16 "
           "throughput with and without speculation on the first 16 prompts",
           (RunConfig(name="batch1", systems=("specfleet:none", "specfleet:qwen-0.5b", "hf-assisted:qwen-0.5b"),
                      num_prompts=20, max_tokens=64, batch_sizes=(1,)),
            RunConfig(name="batched", systems=("specfleet:none", "specfleet:qwen-0.5b"), num_prompts=16,
                      max_tokens=64, batch_sizes=(4, 16))),
           (Check("batch 1: specfleet spec >= 1.1x transformers assisted", "batch1", ("specfleet:qwen-0.5b", 1),
                  ("hf-assisted:qwen-0.5b", 1), "throughput_tok_s", 1.1),
            Check("batch 1: specfleet spec >= 1.8x specfleet autoregressive", "batch1", ("specfleet:qwen-0.5b", 1),
                  ("specfleet:none", 1), "throughput_tok_s", 1.8),
            Check("batch 4: speculation vs none (reported, not a target)", "batched", ("specfleet:qwen-0.5b", 4),
                  ("specfleet:none", 4), "throughput_tok_s", 0.0),
            Check("batch 16: speculation vs none (reported, not a target)", "batched", ("specfleet:qwen-0.5b", 16),
                  ("specfleet:none", 16), "throughput_tok_s", 0.0)),
           expected_duration="about 50-60 minutes on 2 CPU cores (batch 1: ~40 min, batches 4/16: ~15 min)"),
    Preset("cpu", "the embedded family on the CPU, greedy, bf16 - every system on 4 HumanEval prompts "
           "(32 new tokens), then 4 ShareGPT first turns (24 new tokens) at batch 1 and 4",
           (RunConfig(name="humaneval", systems=_ALL, num_prompts=4, max_tokens=32, batch_sizes=(1,)),
            RunConfig(name="sharegpt", dataset="sharegpt", shuffle_seed=0, max_prompt_tokens=160,
                      systems=("specfleet:none", "specfleet:qwen-0.5b", "hf"), num_prompts=4, max_tokens=24,
                      batch_sizes=(1, 4))),
           (Check("HumanEval: specfleet spec vs autoregressive", "humaneval", ("specfleet:qwen-0.5b", 1),
                  ("specfleet:none", 1), "throughput_tok_s", 1.0),
            Check("HumanEval: specfleet spec vs transformers assisted", "humaneval", ("specfleet:qwen-0.5b", 1),
                  ("hf-assisted:qwen-0.5b", 1), "throughput_tok_s", 1.0)),
           expected_duration="about 10 minutes on 2 CPU cores (15 without the native bf16 kernel)"),
    Preset("int8", "opt-in weight-only int8 (runtime/formats/quant.py) on the CPU: the 1.5B with and without the 0.5B "
           "draft in bf16 and int8, beside transformers bf16; 4 HumanEval prompts, 32 new tokens, batch 1",
           (RunConfig(name="humaneval", num_prompts=4, max_tokens=32, batch_sizes=(1,),
                      systems=("specfleet:none", "hf", "hf-assisted:qwen-0.5b", "specfleet:none" + _Q8,
                               "specfleet:qwen-0.5b" + _Q8, "specfleet:qwen-0.5b,k=3" + _Q8,
                               "specfleet:prompt-lookup" + _Q8)),),
           (Check("int8 autoregressive vs bf16 autoregressive (a different model: same-size, int8 weights)",
                  "humaneval", ("specfleet:none" + _Q8, 1), ("specfleet:none", 1), "throughput_tok_s", 1.0),
            Check("int8: speculation (0.5B draft) vs int8 autoregressive", "humaneval",
                  ("specfleet:qwen-0.5b" + _Q8, 1), ("specfleet:none" + _Q8, 1), "throughput_tok_s", 1.0),
            Check("int8 speculation vs transformers assisted bf16 (reported, not a target)", "humaneval",
                  ("specfleet:qwen-0.5b" + _Q8, 1), ("hf-assisted:qwen-0.5b", 1), "throughput_tok_s", 0.0)),
           expected_duration="about 10 minutes on 2 CPU cores"),
    Preset("strategies", "each single draft (0.5B depth sweep, prompt lookup, n-gram, staged), fixed "
           "lengths 1-8 vs adaptive, chain vs tree, Minions vote and its ablation, SPIN selection vs "
           "epsilon-greedy and prompt-length greedy; 1.5B target, greedy, batch 1, HumanEval then ShareGPT",
           (RunConfig(name="humaneval", systems=_STRATEGIES, num_prompts=4, max_tokens=64, batch_sizes=(1,)),
            RunConfig(name="sharegpt", dataset="sharegpt", shuffle_seed=0, max_prompt_tokens=160,
                      systems=_STRATEGIES_SHORT, num_prompts=4, max_tokens=64, batch_sizes=(1,))),
           (Check("HumanEval: Minions vote+adaptive vs the best single draft (0.5B)", "humaneval",
                  (f"specfleet:vote({_DRAFTS3})+adaptive[max_length=8]", 1), ("specfleet:qwen-0.5b", 1),
                  "throughput_tok_s", 1.25),
            Check("HumanEval: Minions vote+adaptive vs autoregressive (reported, not a target)", "humaneval",
                  (f"specfleet:vote({_DRAFTS3})+adaptive[max_length=8]", 1), ("specfleet:none", 1),
                  "throughput_tok_s", 0.0),
            Check("ShareGPT: Minions vote+adaptive vs the best single draft (0.5B)", "sharegpt",
                  (f"specfleet:vote({_DRAFTS3})+adaptive[max_length=8]", 1), ("specfleet:qwen-0.5b", 1),
                  "throughput_tok_s", 1.25),
            Check("HumanEval: vote with weightless drafts + adaptive vs the best single draft (0.5B)", "humaneval",
                  (_VOTE_FREE, 1), ("specfleet:qwen-0.5b", 1), "throughput_tok_s", 1.25),
            Check("ShareGPT: vote with weightless drafts + adaptive vs the best single draft (0.5B)", "sharegpt",
                  (_VOTE_FREE, 1), ("specfleet:qwen-0.5b", 1), "throughput_tok_s", 1.25)),
           expected_duration="about 30 minutes for HumanEval and 15 for ShareGPT (50 and 25 without the native "
                             "bf16 kernel) on 2 CPU cores (--parts humaneval for one); add --quantization int8 to run every specfleet system on "
                             "the int8 target"),
    Preset("gguf", "the GGUF files run as they are (native kernels, fp32 activations) against the same "
           "file dequantized to bf16 and llama.cpp on it (a native llama-server in its own process where LLAMA_SERVER "
           "or PATH has one, else llama-cpp-python): 4 HumanEval prompts and 4 "
           "ShareGPT first turns, 32 greedy tokens, batch 1, for the 1.5B and the 0.5B; HumanEval parts add prefill "
           "tok/s at 128/512 tokens, c(k) for k=1..8 and resident memory",
           (_gguf_part("humaneval-1.5b", QWEN_15B, "humaneval"), _gguf_part("sharegpt-1.5b", QWEN_15B, "sharegpt"),
            _gguf_part("humaneval-0.5b", QWEN_05B, "humaneval"), _gguf_part("sharegpt-0.5b", QWEN_05B, "sharegpt")),
           _gguf_checks("humaneval-1.5b", "1.5B", 1.0, micro=True) + _gguf_checks("sharegpt-1.5b", "1.5B", 1.0)
           + _gguf_checks("humaneval-0.5b", "0.5B", 1.0, micro=True) + _gguf_checks("sharegpt-0.5b", "0.5B", 1.0),
           expected_duration="about 15-20 minutes on 2 CPU cores (--parts humaneval-1.5b for one part; "
                             "--rounds 2 to cancel drift)"),
    Preset("fleet", "the default fleet (the CPU default draft, which holds the 0.5B requantized to 4 bits) against "
           "native plain decoding, the weightless fleet (the default without the 0.5B), each single "
           "draft (0.5B native, 0.5B requantized to 4 bits, suffix, prompt lookup), the fleet that adds the 0.5B and "
           "the n-gram model, and llama.cpp on the same file: 10 HumanEval prompts and 10 ShareGPT first turns "
           "(chat template), 96 new tokens, greedy and temperature 0.7 / top-p 0.9, batch 1, two rounds in "
           "alternating order; a fifth part (humaneval-cross) puts the drafts of other model families (SmolLM2-135M, "
           "Gemma-3-270M, through text) and a selector over them beside the same-vocabulary ones; a sixth "
           "(humaneval-streams) runs plain, the default fleet and the weightless fleet at 1, 4 and 8 concurrent "
           "streams (8 HumanEval prompts, 96 greedy tokens, two rounds), each fleet >= 0.97x plain at every count",
           (_fleet_part("humaneval", "humaneval", 0.0), _fleet_part("sharegpt", "sharegpt", 0.0),
            _fleet_part("humaneval-t0.7", "humaneval", 0.7), _fleet_part("sharegpt-t0.7", "sharegpt", 0.7),
            _cross_part(), _streams_part()),
           _fleet_checks("humaneval", 1.8) + _fleet_checks("sharegpt", 1.3) + _fleet_checks("humaneval-t0.7", 1.3)
           + _fleet_checks("sharegpt-t0.7", 0.97) + _cross_checks() + _streams_checks()
           + (Check("humaneval: the fleet >= 1.5x llama.cpp autoregressive", "humaneval", (f"specfleet:{FLEET}", 1),
                    ("llamacpp", 1), "throughput_tok_s", 1.5),),
           expected_duration="about 2-2.5 hours on 2 CPU cores at full size (--parts humaneval and --rounds 1 for "
                             "a run of about 25 minutes)"),
    Preset("workloads", "where users meet speculation - code edits (a whole Python stdlib file and an "
           "edit instruction, the edited file out, up to 512 tokens), multi-turn chat (a later ShareGPT turn with the "
           "earlier ones as context, 128 tokens), tool-call loops (BFCL multi-turn: calls and their results from "
           "BFCL's simulated APIs, then the next call, 64 tokens) and HumanEval fresh code (128 tokens); 4 prompts "
           "each, 1.5B GGUF, greedy, batch 1: specfleet plain and its default speculation beside llama-server's "
           "ngram-mod and draft-simple (0.5B) speculation, two rounds in alternating order; the -warm parts send "
           "each prompt of code edits, chat and tool loops right after what the earlier requests of its loop leave "
           "in a server's cache (the same file under another edit; the conversation up to the new user turn or tool "
           "result), so every system's prefix cache holds the context they share",
           tuple(_workload_part(n) for n in _WORKLOAD_PARTS),
           tuple(c for n in _WORKLOAD_PARTS for c in _workload_checks(n)),
           expected_duration="about 8-25 minutes a part on 2 CPU cores (--parts code-edit for one)"),
    Preset("gpu", "GPU: full HumanEval (164), 256 ShareGPT and 256 chitchat prompts, batch sizes 1-32, bf16",
           (RunConfig(name="humaneval", systems=_ALL, num_prompts=164, max_tokens=128, device="cuda",
                      batch_sizes=(1, 2, 4, 8, 16, 32), kv_cache_mb=8192),
            RunConfig(name="sharegpt", dataset="sharegpt", shuffle_seed=0, num_prompts=256, systems=_ALL,
                      max_tokens=256, device="cuda", batch_sizes=(1, 2, 4, 8, 16, 32), kv_cache_mb=8192),
            RunConfig(name="chitchat", dataset="chitchat", shuffle_seed=0, num_prompts=256, systems=_ALL,
                      max_tokens=128, device="cuda", batch_sizes=(1, 2, 4, 8, 16, 32), kv_cache_mb=8192)),
           (Check("HumanEval batch 1: specfleet spec vs transformers assisted", "humaneval",
                  ("specfleet:qwen-0.5b", 1), ("hf-assisted:qwen-0.5b", 1), "throughput_tok_s", 1.1),
            Check("HumanEval batch 1: specfleet spec vs autoregressive", "humaneval", ("specfleet:qwen-0.5b", 1),
                  ("specfleet:none", 1), "throughput_tok_s", 1.0)),
           expected_duration="hours at full size: pass --num-prompts 32 for a run of minutes"),
)}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise SpecfleetError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} "
                             "(or give no preset and set the options yourself)")
    return PRESETS[name]


def select_parts(preset: Preset, names: list[str] | None) -> Preset:
    if not names:
        return preset
    known = [r.name for r in preset.runs]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SpecfleetError(f"preset {preset.name} has no part(s) {unknown}; its parts are {known}")
    return replace(preset, runs=tuple(r for r in preset.runs if r.name in names),
                   checks=tuple(c for c in preset.checks if c.part in names))  # a left-out part's claims are not run
