"""Running a preset: load each model once, tokenize the prompts once, then run every system over the
same prompt ids at every batch size, one wave of `batch_size` prompts at a time.

Order of work in a part: pick and tokenize prompts -> for each system: build it, warm it up with one wave
per batch size (its first prompts reversed: the same lengths, nothing to reuse; on a GPU, 32 tokens each,
so the step shapes' CUDA graphs are mostly captured before the timed waves),
time its waves at each batch size, close it -> compare outputs with the baseline -> summarize.
Systems run one after another in the same process (not interleaved) so that only one system's KV
cache and draft are alive at a time; loaded weights are shared through a ModelPool, which drops a
model once no remaining system of the part needs it (a 1.5B target and its transformers copy are
then never in memory together when the specfleet systems come first).
"""
from __future__ import annotations

import gc
import statistics
import sys
import time
from dataclasses import asdict, replace

import torch
from tqdm import tqdm

from specfleet.bench import datasets, gguf_micro, llamacpp, metrics
from specfleet.bench.hf import PROMPT_LOOKUP_NAMES, HFSystem, load_hf_model
from specfleet.bench.presets import Preset, RunConfig
from specfleet.bench.roofline import measure_bandwidth, weight_bytes_per_step
from specfleet.bench.systems import Settings, SpecfleetSystem, SystemSpec, parse_system
from specfleet.errors import SpecfleetError
from specfleet.runtime.loading.build import parse_device, parse_dtype
from specfleet.strategies.factory import DEFAULT_HEAD_VOCAB


class ModelPool:
    """Loaded models by key: each loads on first use and is dropped as soon as no remaining system
    needs it, so a specfleet target and a transformers copy of it are rarely alive together."""

    def __init__(self):
        self._models: dict[tuple, object] = {}

    def get(self, key: tuple, load):
        if key not in self._models:
            self._models[key] = load()
        return self._models[key]

    def keep_only(self, keys: set[tuple]) -> None:
        for key in [k for k in self._models if k not in keys]:
            del self._models[key]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _keys(specs: list[SystemSpec], cfg: RunConfig) -> set[tuple]:
    """The pool entries these systems use."""
    keys = {_ours_key(cfg, _quantization(s, cfg)) for s in specs if s.kind == "specfleet"}
    if any(s.kind in ("hf", "hf-assisted") for s in specs):
        keys.add(("hf", cfg.model, cfg.dtype, cfg.device))
    return keys | {("hf", s.draft, cfg.dtype, cfg.device) for s in specs if _is_hf_model_draft(s)}


def _ours_key(cfg: RunConfig, quantization: str) -> tuple:
    return ("ours", cfg.model, cfg.dtype, cfg.device, quantization)


def _quantization(spec: SystemSpec, cfg: RunConfig) -> str | None:
    """The weights a specfleet system runs: its own `quantization=` option, else the part's, else dense in the
    part's dtype (so a preset's figures keep their meaning whatever LLM's default is)."""
    return spec.options.get("quantization", cfg.quantization) or "none"


def _is_hf_model_draft(spec: SystemSpec) -> bool:
    return spec.kind == "hf-assisted" and spec.draft.lower() not in PROMPT_LOOKUP_NAMES


def validate(preset: Preset) -> None:
    """Catch mistakes before anything loads: bad system names, batch sizes, token counts, devices."""
    for cfg in preset.runs:
        specs = [parse_system(s) for s in cfg.systems]  # raises on a bad name
        if not specs:
            raise SpecfleetError(f"part {cfg.name}: no systems to run")
        if len({s.label for s in specs}) != len(specs):
            raise SpecfleetError(f"part {cfg.name}: a system is listed twice: {list(cfg.systems)}")
        if not cfg.batch_sizes or min(cfg.batch_sizes) < 1:
            raise SpecfleetError(f"part {cfg.name}: batch sizes must be positive integers, got {cfg.batch_sizes}")
        if cfg.max_tokens < 1 or cfg.num_prompts < 1 or cfg.rounds < 1:
            raise SpecfleetError(f"part {cfg.name}: --max-tokens, --num-prompts and --rounds must be at least 1")
        if cfg.chat not in ("auto", "on", "off"):
            raise SpecfleetError(f"part {cfg.name}: --chat must be auto, on or off, got {cfg.chat!r}")
        if cfg.temperature != 0 and any(s.kind == "llamacpp" for s in specs):
            raise SpecfleetError(f"part {cfg.name}: the llama.cpp system is measured greedy only, and this part "
                                 f"samples at temperature {cfg.temperature}: leave llamacpp out of its systems")
        if cfg.loop and tuple(cfg.batch_sizes) != (1,):
            raise SpecfleetError(f"part {cfg.name}: a loop part sends each prompt after its predecessor, one at a "
                                 f"time: its batch sizes must be (1,), got {cfg.batch_sizes}")
        if cfg.loop and any(s.kind in ("hf", "hf-assisted") for s in specs):
            raise SpecfleetError(f"part {cfg.name}: transformers keeps no prefix cache between requests, so a loop "
                                 f"part cannot run the hf systems")
        parse_dtype(cfg.dtype)
        parse_device(cfg.device)


def check_hf_drafts(preset: Preset) -> None:
    """Every hf-assisted draft that is not prompt lookup must resolve to a model, before any run starts."""
    for cfg in preset.runs:
        for s in map(parse_system, cfg.systems):
            if _is_hf_model_draft(s):
                _check_hf_draft(s)


def _check_hf_draft(spec: SystemSpec) -> None:
    from specfleet.core.model_ref import ModelRef
    from specfleet.registry import resolve_model

    try:
        resolve_model(ModelRef.parse(spec.draft).name)
    except SpecfleetError as e:
        raise SpecfleetError(f"system {spec.label!r}: transformers assists only with a draft model or prompt "
                             f"lookup, and {spec.draft!r} did not load as a model: {e}") from e


def run_preset(preset: Preset, install: bool = False, progress: bool = True) -> dict:
    validate(preset)
    check_hf_drafts(preset)
    if install:
        needed = {c.dataset for c in preset.runs if c.dataset in datasets.DATASETS}
        missing = [n for n in needed if not _dataset_installed(n)]
        datasets.install_datasets(missing)
    bandwidths: dict[str, float] = {}  # measured once per device type
    parts = [run_part(cfg, bandwidths, progress) for cfg in preset.runs]
    return {"preset": preset.name, "description": preset.description,
            "expected_duration": preset.expected_duration,
            "bandwidth_bytes_s": bandwidths, "parts": parts, "checks": evaluate_checks(preset, parts)}


def _dataset_installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(datasets.DATASETS[name].module) is not None


def run_part(cfg: RunConfig, bandwidths: dict, progress: bool = True) -> dict:
    from specfleet.llm import load_model

    pool = ModelPool()
    dtype, device = parse_dtype(cfg.dtype), parse_device(cfg.device)
    first = _quantization(parse_system(cfg.systems[0]), cfg)
    target, tokenizer = pool.get(_ours_key(cfg, first), lambda: load_model(cfg.model, dtype, device,
                                                                           quantization=first))
    prompts, prompt_ids, is_chat = _prompts(cfg, tokenizer, target.config.max_position_embeddings)
    previous_ids = _previous_ids(cfg, prompts, tokenizer, is_chat) if cfg.loop else None
    if device.type not in bandwidths:
        bandwidths[device.type] = measure_bandwidth(device)
    weight_bytes = weight_bytes_per_step(target)
    eos = tuple(target.config.eos_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    del target, tokenizer  # the pool owns them now and drops them when no remaining system needs them
    bound = metrics.roofline_tok_s(bandwidths[device.type], weight_bytes)
    specs = [parse_system(s) for s in cfg.systems]
    baseline = cfg.baseline or next((s.label for s in specs if s.is_autoregressive), None)
    settings = Settings(cfg.max_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, cfg.ignore_eos)
    order = [spec for r in range(cfg.rounds) for spec in (specs if r % 2 == 0 else specs[::-1])]
    waves_total = sum(-(-len(prompt_ids) // b) for b in cfg.batch_sizes) * len(order)
    bar = tqdm(total=waves_total, desc=cfg.name, unit="wave", disable=not progress, dynamic_ncols=True)
    timed = _Timings()
    system_info = {}
    for i, spec in enumerate(order):
        bar.set_postfix_str(f"{spec.label}: loading")
        pool.keep_only(_keys(order[i:], cfg))
        if spec.kind == "llamacpp" and not llamacpp.available(spec):
            _skip_llamacpp(spec, cfg, timed, bar, len(prompt_ids))
            continue
        # one system for all batch sizes, or (fresh_per_batch) one per batch size
        for sizes in ([(b,) for b in cfg.batch_sizes] if cfg.fresh_per_batch else [tuple(cfg.batch_sizes)]):
            system = _build(spec, cfg, pool, eos, pad)
            system_info.setdefault(spec.label, {"label": spec.label, "kind": spec.kind, "draft": spec.draft,
                                                "settings": system.notes})
            bar.set_postfix_str(f"{spec.label}: warm-up")
            # specfleet: a wave of each batch size (on a GPU its step shapes' graphs are captured here, untimed);
            # the others as they were, one prompt (transformers' assisted generation takes one at a time)
            for b in (sizes if spec.kind == "specfleet" else (1,)):
                system.generate([warmup_ids(ids) for ids in prompt_ids[:b]],
                                replace(settings, max_tokens=min(8 if device.type == "cpu" else 32, settings.max_tokens)))
            if cfg.micro and sizes[0] == cfg.batch_sizes[0]:  # prefill, c(k), memory: once per system and round
                system_info[spec.label].setdefault("micro", []).append(gguf_micro.measure(system, prompt_ids))
            for b in sizes:
                timed.run(system, b, prompts, prompt_ids, settings, bar, previous_ids)
            if cfg.rowcheck_prompts and spec.kind == "specfleet" and sizes[-1] == cfg.batch_sizes[-1]:
                bar.set_postfix_str(f"{spec.label}: per-row check")
                timed.rowcheck(system, prompt_ids[:cfg.rowcheck_prompts], settings)
            state = system.strategy_state() if hasattr(system, "strategy_state") else {}
            if state:  # once per system, round (and batch size when fresh_per_batch), after its waves
                system_info[spec.label].setdefault("strategy_state", []).append(
                    {"batch_sizes": list(sizes), **state} if cfg.fresh_per_batch else state)
            system.close()
            del system
    system_info = [system_info[s.label] for s in specs if s.label in system_info]
    pool.keep_only(set())
    bar.close()
    timed.mark_matches(baseline, prompts)
    coverage = timed.head_coverage(baseline)
    summaries = timed.summaries(specs, cfg.batch_sizes)
    metrics.add_speedups(summaries, baseline)
    metrics.add_roofline(summaries, bound)
    return {"name": cfg.name, "config": asdict(cfg), "chat_template": is_chat, "baseline": baseline,
            "systems": system_info, "weight_bytes_per_step": weight_bytes, "roofline_tok_s": bound,
            "prompts": [{"id": p.prompt_id, "prompt_tokens": len(ids)} for p, ids in zip(prompts, prompt_ids)],
            "summaries": summaries, "head_vocab_coverage": coverage, "skipped": timed.skipped, "requests": [r.as_dict() for r in timed.requests]}


class _Timings:
    """What the waves measured: per-request records, per-wave records, output ids, skipped runs."""

    def __init__(self):
        self.requests: list[metrics.RequestRecord] = []
        self.waves: list[metrics.WaveRecord] = []
        self.outputs: dict[tuple[str, int, int], list[int]] = {}  # (system, batch, prompt index) -> ids
        self.skipped: list[dict] = []
        self.rows: dict[str, "RowReport"] = {}  # system -> its per-row check (bench/rowcheck.py), all rounds

    def rowcheck(self, system, prompt_ids: list[list[int]], settings: Settings) -> None:
        """Replay every row of `prompt_ids` on `system`'s engine as plain decode steps (untimed)."""
        from specfleet.bench.rowcheck import RowReport, check_engine_run
        from specfleet.sampling_params import SamplingParams

        params = SamplingParams(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                                seed=None if settings.temperature == 0 else settings.seed,
                                max_tokens=settings.max_tokens, ignore_eos=settings.ignore_eos)
        _, report = check_engine_run(system.llm.engine, prompt_ids, params)
        self.rows.setdefault(system.label, RowReport()).merge(report)

    def run(self, system, b: int, prompts: list, prompt_ids: list[list[int]], settings: Settings, bar,
            previous_ids: list[list[int]] | None = None) -> None:
        """Time `system` over all prompts in waves of `b`; with `previous_ids` (a loop part, b = 1), each prompt
        right after what the earlier requests of its loop left in the cache, sent untimed for one token."""
        if system.max_batch_size is not None and b > system.max_batch_size:
            self.skipped.append({"system": system.label, "batch_size": b,
                                 "reason": f"runs batch size {system.max_batch_size} at most"})
            bar.update(-(-len(prompt_ids) // b))
            return
        bar.set_postfix_str(f"{system.label} batch {b}")
        for start in range(0, len(prompt_ids), b):
            wave = prompt_ids[start:start + b]
            if previous_ids is not None:
                system.generate([previous_ids[start]], replace(settings, max_tokens=1, ignore_eos=True))
            t0 = time.perf_counter()
            gens = system.generate(wave, settings)
            wall = time.perf_counter() - t0
            for j, g in enumerate(gens):
                self.outputs[(system.label, b, start + j)] = g.output_ids
                self.requests.append(_record(system.label, b, prompts[start + j].prompt_id, len(wave[j]), g))
            ttfts = [g.ttft_s for g in gens if g.ttft_s is not None]
            self.waves.append(metrics.WaveRecord(system.label, b, len(wave), sum(len(g.output_ids) for g in gens),
                                                 wall, max(ttfts) if ttfts else None,
                                                 sum(g.num_first_tokens for g in gens)))
            bar.update(1)

    def mark_matches(self, baseline: str | None, prompts: list) -> None:
        """Flag each request whose output ids equal the baseline system's for the same prompt and batch."""
        index = {p.prompt_id: i for i, p in enumerate(prompts)}
        for r in self.requests:
            ref = self.outputs.get((baseline, r.batch_size, index[r.prompt_id]))
            if ref is not None and r.system != baseline:
                r.matches_baseline = self.outputs[(r.system, r.batch_size, index[r.prompt_id])] == ref

    def head_coverage(self, baseline: str | None, cuts=(32768, DEFAULT_HEAD_VOCAB)) -> dict[str, float]:
        """Share of the baseline's output tokens below each head cut: how often a draft with that reduced
        head could have proposed the token the target produced (strategies/factory.py DEFAULT_HEAD_VOCAB)."""
        ids = [t for (system, _, _), out in self.outputs.items() if system == baseline for t in out]
        return {str(n): round(sum(t < n for t in ids) / len(ids), 4) for n in cuts} if ids else {}

    def summaries(self, specs: list[SystemSpec], batch_sizes) -> list[dict]:
        rows = []
        for spec in specs:
            for b in batch_sizes:
                rs = [r for r in self.requests if r.system == spec.label and r.batch_size == b]
                ws = [w for w in self.waves if w.system == spec.label and w.batch_size == b]
                if rs:
                    rows.append({"system": spec.label, "batch_size": b, **metrics.summarize(rs, ws)})
                    report = self.rows.get(spec.label)
                    if report is not None:
                        rows[-1].update(rows_checked=report.rows_checked, rows_differing=report.rows_differing,
                                        rows_max_abs_diff=report.as_dict()["max_abs_logit_diff"])
        return rows


def _prompts(cfg: RunConfig, tokenizer, max_positions: int):
    if tokenizer is None:
        raise SpecfleetError(f"{cfg.model} has no tokenizer; the benchmark needs one to encode prompts")
    source, default_chat = datasets.iter_prompts(cfg.dataset)
    is_chat = default_chat if cfg.chat == "auto" else cfg.chat == "on"
    if is_chat and not getattr(tokenizer, "chat_template", None):
        raise SpecfleetError(f"{cfg.model} has no chat template; rerun with --chat off")
    limit = min(cfg.max_prompt_tokens, max_positions - cfg.max_tokens - 64)
    encoded: dict[str, list[int]] = {}

    def keep(p: datasets.Prompt) -> bool:
        encoded[p.prompt_id] = encode_prompt(p, tokenizer, is_chat)
        return 0 < len(encoded[p.prompt_id]) <= limit

    prompts = datasets.select(source, cfg.num_prompts, cfg.shuffle_seed, keep)
    return prompts, [encoded[p.prompt_id] for p in prompts], is_chat


def _previous_ids(cfg: RunConfig, prompts: list, tokenizer, is_chat: bool) -> list[list[int]]:
    """The token ids of each prompt's `previous` (a loop part); an error where the data has none."""
    out = []
    for p in prompts:
        previous = p.previous_prompt()
        if previous is None:
            raise SpecfleetError(f"part {cfg.name}: prompt {p.prompt_id} of {cfg.dataset} has no earlier request in "
                                 f"a loop, so it cannot run as a loop part")
        out.append(encode_prompt(previous, tokenizer, is_chat))
    return out


def warmup_ids(ids: list[int]) -> list[int]:
    """The warm-up prompt: the first prompt's ids in reverse, as long as it but sharing no prefix with it, so a
    system with a prefix cache (specfleet's is on by default) or a drafter that remembers past outputs (suffix
    decoding) gets nothing of the first timed prompt from its warm-up, as a server started without them does."""
    return ids[::-1]


def encode_prompt(prompt: datasets.Prompt, tokenizer, chat: bool) -> list[int]:
    """Token ids every system receives: the chat template exactly as specfleet's LLM.chat applies it."""
    if chat:
        tools = prompt.tool_list()  # tool-call loops offer tools: the template renders them (as LLM.chat's server does)
        text = tokenizer.apply_chat_template(prompt.as_messages(), tokenize=False, add_generation_prompt=True,
                                             **({"tools": tools} if tools else {}))
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt.as_raw_text(), add_special_tokens=True)


def _skip_llamacpp(spec: SystemSpec, cfg: RunConfig, timed: "_Timings", bar, num_prompts: int) -> None:
    hint = llamacpp.install_hint()
    if not any(s["system"] == spec.label for s in timed.skipped):
        what = ("no native llama-server (LLAMA_SERVER), which its speculation needs" if spec.draft
                else "neither a llama-server (LLAMA_SERVER) nor llama-cpp-python")
        print(f"specfleet bench: skipping {spec.label}: {what}; {hint}", file=sys.stderr)
    timed.skipped.append({"system": spec.label, "batch_size": None, "reason": f"not installed: {hint}"})
    bar.update(sum(-(-num_prompts // b) for b in cfg.batch_sizes))


def _build(spec: SystemSpec, cfg: RunConfig, pool: ModelPool, eos: tuple[int, ...], pad: int):
    """A system for the part; in a loop part llama.cpp reuses its cached prompt, as specfleet's prefix cache
    always does."""
    from specfleet.llm import load_model

    dtype, device = parse_dtype(cfg.dtype), parse_device(cfg.device)
    if spec.kind == "llamacpp":
        return llamacpp.make_system(spec, cfg.model, eos_token_ids=eos, cache_prompt=cfg.loop)
    if spec.kind == "specfleet":
        quant = _quantization(spec, cfg)
        target, tokenizer = pool.get(_ours_key(cfg, quant), lambda: load_model(cfg.model, dtype, device,
                                                                               quantization=quant))
        if "quantization" not in spec.options:
            spec = replace(spec, options={**spec.options, "quantization": quant})
        return SpecfleetSystem(spec, cfg.model, target, tokenizer, dtype=cfg.dtype, device=cfg.device,
                               spec_len=cfg.spec_len, max_batch_size=max(cfg.batch_sizes),
                               kv_cache_mb=cfg.kv_cache_mb)
    hf_target = pool.get(("hf", cfg.model, cfg.dtype, cfg.device), lambda: load_hf_model(cfg.model, dtype, device))
    draft = None
    if _is_hf_model_draft(spec):
        draft = pool.get(("hf", spec.draft, cfg.dtype, cfg.device), lambda: load_hf_model(spec.draft, dtype, device))
    return HFSystem(spec, hf_target, draft, device=device, spec_len=cfg.spec_len, pad_token_id=pad,
                    eos_token_ids=eos)


def _record(label: str, batch_size: int, prompt_id: str, prompt_tokens: int, g) -> metrics.RequestRecord:
    s = g.spec
    return metrics.RequestRecord(label, batch_size, prompt_id, prompt_tokens, len(g.output_ids), g.latency_s,
                                 g.ttft_s, s.get("steps"), s.get("drafted"), s.get("accepted"),
                                 s.get("draft_time_s"), s.get("verify_time_s"), s.get("accepted_at_depth"),
                                 strategy_overhead_s=s.get("strategy_overhead_s"), cached_tokens=s.get("cached_tokens"),
                                 judged=s.get("judged"))


def evaluate_checks(preset: Preset, parts: list[dict]) -> list[dict]:
    by_name = {p["name"]: p for p in parts}
    results = []
    for c in preset.checks:
        part = by_name.get(c.part)
        if c.at_most is not None:
            value = _metric(part, c.a, c.metric) if part else None
            results.append({"label": c.label, "part": c.part, "a": list(c.a), "b": list(c.b), "metric": c.metric,
                            "min_ratio": 0.0, "at_most": c.at_most, "value": value, "ratio": None,
                            "passed": None if value is None else value <= c.at_most})
            continue
        ratio = metrics.ratio(_metric(part, c.a, c.metric), _metric(part, c.b, c.metric)) if part else None
        results.append({"label": c.label, "part": c.part, "a": list(c.a), "b": list(c.b), "metric": c.metric,
                        "min_ratio": c.min_ratio, "ratio": ratio,
                        "passed": None if ratio is None or c.min_ratio <= 0 else ratio >= c.min_ratio})
    return results


def _metric(part: dict, system: tuple[str, int], metric: str) -> float | None:
    """A summary's metric for (system, batch), or for "micro:<name>" the median over rounds of that system's
    bench/gguf_micro.py figure; None where it was not measured."""
    if not metric.startswith("micro:"):
        return metrics.value_of(part["summaries"], system, metric)
    name = metric.removeprefix("micro:")
    info = next((s for s in part.get("systems", []) if s["label"] == system[0]), {})
    values = [m[name] for m in info.get("micro", []) if m.get(name) is not None]
    return statistics.median(values) if values else None
