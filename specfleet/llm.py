"""The offline API, in the style of vLLM:

    llm = LLM(model="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", dtype="bfloat16")
    outs = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=64))
    outs = llm.chat([{"role": "user", "content": "Write a haiku"}])

A model already loaded (or built) is wrapped without loading it again, e.g. one target under several drafts:

    base = LLM("smollm2-135m-instruct", draft=None, dtype="float32")
    spec = LLM.from_model(base.model, base.tokenizer, draft="suffix", name="smollm2-135m-instruct", dtype="float32")
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from specfleet.config import CacheConfig, EngineConfig, SchedulerConfig
from specfleet.engine.engine import Engine
from specfleet.errors import InvalidRequestError, ModelLoadError
from specfleet import registry
from specfleet.registry import lookup
from specfleet.outputs import RequestOutput
from specfleet.runtime.loading.build import parse_device, parse_dtype
from specfleet.runtime.loading import load_model
from specfleet.runtime.model.decoder import DecoderLM
from specfleet.runtime.formats.quant import parse_quantization, quantize_model, resolve_quantization
from specfleet.runtime.config import RuntimeConfig
from specfleet.runtime.loading.tokenizer import per_thread
from specfleet.sampling_params import SamplingParams
from specfleet.drafting.forced_tokens import ForcedTokensProposer
from specfleet.runtime.sample.structured import compiler_for
from specfleet.strategies.factory import SpecConfig, build_proposer
from specfleet.strategies.structured_front import structured_front

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
# The default draft of the default model, per device. On the CPU the default stays weightless (d ~ 0),
# though a draft model now pays on fresh code: since the grouped 32-weight kernels the 0.5B draft costs 0.38
# of a target step per token (0.30 requantized, `qwen-0.5b[quant=q4_0]`), and the fleet with it made 1.45x
# against the weightless fleet's 1.27x on raw HumanEval prompts, 1.41x against 1.18x with the chat template,
# and about the same elsewhere (code edits 2.12x / 2.10x, chat 1.25x / 1.23x, tool loops 1.02x / 1.02x;
# workloads-cpu-20261127T103541Z; 1.37x against 1.23x in workloads-cpu-20261127T125732Z). It costs ~11 s more
# loading and ~0.4 GB more memory, and at 4 and 8 concurrent streams the fleet with it is only level with plain
# (0.83x at 8, fleet-cpu-20261127T095718Z; 0.92x once the fleet times the plain step at every batch size,
# fleet-cpu-20261127T133314Z; 0.96-1.01x at 4 and 1.01-1.03x at 8 since it no longer feeds the 0.5B prompts while
# others prefill, fleet-cpu-20261127T154958Z / ...T155730Z): an option (README), not the default. The fleet of
# the suffix-tree draft and prompt lookup, trimmed per step to what verification costs on the machine, made
# 1.20x / 1.11x / 1.13x plain decoding on the fleet preset's HumanEval, ShareGPT and HumanEval-t0.7 parts
# against 1.16x / 1.11x / 1.12x for suffix alone, and 1.01x against 1.00x on ShareGPT-t0.7. On CUDA the same
# fleet: on an H100 (eager) it made 1.82x against the 0.5B draft's 1.16x at batch 1, and with CUDA graphs an
# H200 steps the 0.5B's shape in 2.87 ms against the 1.5B's 4.77: d = 0.6, too dear for its 0.8 acceptance
# to pay. (The runs are in benchmarks/RESULTS.md: the fleet preset and the GPU step costs.)
# On the CPU the fleet also holds the retrieval draft over the Python standard library (`datastore`, built once
# per tokenizer, ~11 s): fresh code repeats idioms the request's own text has not shown yet. On a Cascade Lake
# Xeon it made 1.19x against 1.12x on HumanEval and 1.19x against 1.16x on ShareGPT (draft_cost.py, medians of 3
# rounds; draft-cost-cpu-20261128T133607Z, ...T134159Z). Not yet on CUDA: no GPU measured it.
# The CPU fleet also holds the 0.5B draft, requantized to Q4_0 at load (kept in the cache after the first time),
# wherever the 0.5B is installed (`specfleet models install qwen-0.5b`; the README's first command installs it). The
# fleet learns the 0.5B's cost from more than its first cold call, keeps exploring the depths it stopped drafting,
# and feeds it a prompt for a forced re-measurement only where a perfect draft could repay the feed
# (strategies/fleet.py). Session 32 made it the default, then took it back when code edits ran 2.11x against the
# weightless fleet's 2.35x (whole files fed to the 0.5B by forced calls, workloads-cpu-20261128T191623Z). With the
# repay rule (session 33, Emerald Rapids Xeon, avx512vnni kernels), against the weightless fleet: code edits 2.43x
# against 2.43x (workloads-cpu-20261128T203001Z); HumanEval 1.45x against 1.28x and ShareGPT 1.24x against 1.24x
# (draft_cost.py, medians of 3 rounds of 4 prompts; draft-cost-cpu-20261128T204642Z, ...T204922Z); 1.39x / 1.13x /
# 1.03x against 1.31x / 1.06x / 1.02x at 1 / 4 / 8 concurrent HumanEval streams (fleet-cpu-20261128T204925Z). It
# costs ~0.35 GB of memory and ~1.6 s of loading. Without the 0.5B installed the default is the weightless fleet.
# That holds where the kernels have an integer dot-product instruction (the VNNI paths; ARM's dot product is
# unmeasured and keeps it). On the AVX2 path every verification row costs what its multiplies cost (a Zen 2 issues
# one vector integer multiply a cycle: benchmarks/kernels/ports.py), and there the 0.5B's chains cost more than they
# bring: on a Zen 2 (AMD EPYC family 23 model 49, session 40) the fleet with it made 1.235x plain on HumanEval and
# 0.91x on ShareGPT (0.65x on the first round, a fresh fleet, as every `specfleet generate` has), against the
# weightless fleet's 1.27x and 1.18x (draft-cost-cpu-20261201T222851Z, ...T223517Z); at 1 / 4 / 8 HumanEval streams
# 1.135 / 1.135 / 1.03x against 1.09 / 1.09 / 1.05x (fleet-cpu-20261201T223627Z). Level on fresh code, a loss on
# chat: so the AVX2 path's default is the weightless fleet, which ran above plain in every run; `--draft` still
# takes the 0.5B there.
CPU_DRAFT_MODEL = "qwen-0.5b[quant=q4_0]"
DEFAULT_DRAFT = {"cpu": f"fleet(suffix,prompt-lookup,datastore,{CPU_DRAFT_MODEL})", "cuda": "fleet(suffix,prompt-lookup)"}
# the kernels' ISA paths where the CPU default leaves the 0.5B out (its rows cost too much there, above)
NO_MODEL_DRAFT_PATHS = frozenset({"avx2"})


def _kernel_path() -> str | None:
    """The GGUF kernels' ISA path in this process (SPECFLEET_ISA or the CPU's best); None where none runs or the
    setting is not runnable (the model's loading then says why)."""
    from specfleet.runtime.backends.native import kernels as native_backend

    try:
        return native_backend.isa()
    except ValueError:
        return None


def default_draft(model: str, device, with_tokenizer: bool = True) -> str | None:
    """The draft `LLM()` (and the CLI's / server's `--draft default`) uses: the per-device default for the
    default model (by its name or an alias, e.g. `qwen-1.5b`), none for any other model. The CPU default's
    0.5B member is left out where the 0.5B is not installed, and on the AVX2 kernel path (NO_MODEL_DRAFT_PATHS). A
    target handed in without a tokenizer (`LLM.from_model`) drafts without the datastore, whose corpus is text to
    tokenize."""
    try:
        if lookup(str(model)).name != DEFAULT_MODEL:
            return None
    except ModelLoadError:  # a path or an unregistered name
        return None
    draft = DEFAULT_DRAFT.get(getattr(device, "type", str(device)).split(":")[0], DEFAULT_DRAFT["cuda"])
    if f",{CPU_DRAFT_MODEL}" in draft and (not registry.is_installed(CPU_DRAFT_MODEL.split("[")[0])
                                           or _kernel_path() in NO_MODEL_DRAFT_PATHS):
        draft = draft.replace(f",{CPU_DRAFT_MODEL}", "")
    return draft if with_tokenizer else draft.replace(",datastore", "")
_USE_DEFAULT = object()


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, draft: str | None = _USE_DEFAULT, *, dtype: str = "bfloat16",
                 device: str = "cpu", num_speculative_tokens: int = 4, top_children: int = 1, max_nodes: int = 16,
                 kv_cache_bytes: int = 1 << 30, block_size: int = 16, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None, max_num_prefills: int = 4,
                 mixed_step_factor: float | None = 2.0, quantization: str | None = "auto",
                 enable_prefix_caching: bool = True, grammar_draft: bool = True, runtime: RuntimeConfig | None = None,
                 _loaded: tuple[DecoderLM, object] | None = None):
        """Load `model` (a registered name or a path) and serve it with `draft` (the default: `default_draft`;
        None: no speculation). `LLM.from_model` wraps a model already loaded instead (`_loaded` is its way in).

        `quantization` applies to the target and every draft model (a draft may override it with
        `[quant=...]`, see strategies/spec_language.py); speculation is lossless against the target as loaded:
        - "auto" (default): a GGUF model on the CPU runs as the file is ("gguf"), anything else dense;
        - "gguf": keep the GGUF file's block formats (Q4_K, Q6_K, ...), native kernels, fp32 activations
          (`dtype` is unused for such a model: its activations and dense tensors are fp32);
        - "none": dense weights in `dtype` (a GGUF file is dequantized once into a cache);
        - "int8": weight-only per-channel int8 (runtime/formats/quant.py);
        - "q4_0" / "q8_0" / "q4_k": every matrix requantized into that GGUF format at load.
        `max_num_batched_tokens` is the per-step token budget: running requests' decode/verify rows
        first, then chunks of at most `max_num_prefills` waiting prompts share what is left (chunked
        prefill, engine/scheduler.py), so a long prompt never stalls the requests already decoding;
        `mixed_step_factor` keeps a step that mixes prompt chunks with other requests to about that many
        decode steps' time (measured; None: only the budget bounds it). `enable_prefix_caching` keeps the
        KV of finished requests' full blocks and maps it into later requests that start with the same
        tokens (a chat's next turn, an agent's system prompt), for the target and every draft model.
        `grammar_draft` puts the grammar draft in front of the drafts for requests with
        `structured_outputs` (strategies/structured_front.py; `draft=None` turns speculation off altogether,
        the grammar draft included). `runtime` sets how the target computes (runtime/config.py:
        the linear layers' routes, the fused native forward, the CUDA invariant kernels; default: the
        environment's and this machine's best); it never changes what is computed."""
        self.dtype = parse_dtype(dtype)
        self.device = parse_device(device)
        self.quantization = parse_quantization(quantization)
        if draft is _USE_DEFAULT:
            draft = default_draft(model, self.device, with_tokenizer=_loaded is None or _loaded[1] is not None)
        if _loaded is not None:  # LLM.from_model: a model the caller loaded or built
            given, self.tokenizer = _loaded
            self.model = given
            have = getattr(given, "quantization", None)
            if self.quantization == "int8" and have != "int8":
                import copy

                self.model = quantize_model(copy.deepcopy(given), self.quantization)  # the caller's stays as is
            elif self.quantization not in ("auto", "int8", have) and not (
                    have is None and resolve_quantization(self.quantization, True, self.device) is None):
                # (a dense model handed in for a block format is what loading falls back to without the kernels)
                raise InvalidRequestError(f"quantization {self.quantization!r} is applied when a model is loaded; "
                                          f"the model handed in is {have or 'dense'}")
        else:
            self.model, self.tokenizer = load_model(model, self.dtype, self.device, quantization=self.quantization)
        if runtime is not None:
            self.model.set_runtime(runtime)
        # the server encodes on its tokenizer thread while the engine thread decodes (runtime/loading/tokenizer.py)
        self.tokenizer = per_thread(self.tokenizer)
        self.model_name = model
        self.draft_name = draft
        spec = SpecConfig(num_speculative_tokens, top_children, max_nodes, prefix_caching=enable_prefix_caching)
        proposer = build_proposer(draft, spec, self.model.config.vocab_size, self.dtype, self.device,
                                  quantization=self.quantization, target_tokenizer=self.tokenizer,
                                  target_model=self.model)
        if grammar_draft and self.tokenizer is not None:
            tokenizer, vocab = self.tokenizer, self.model.config.vocab_size
            proposer = structured_front(proposer, ForcedTokensProposer(lambda: compiler_for(tokenizer, vocab)))
        config = EngineConfig(CacheConfig(block_size, kv_cache_bytes, enable_prefix_caching),
                              SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len,
                                              max_num_prefills=max_num_prefills, mixed_step_factor=mixed_step_factor))
        self.engine = Engine(self.model, self.tokenizer, config, proposer, self.device)
        if self.device.type == "cuda":  # CUDA graphs: every decode and verification shape captured now, not mid-run
            depth = max(num_speculative_tokens, getattr(proposer, "num_speculative_tokens", 0) or 0) if proposer else 0
            self.engine.capture_graphs(max_new=depth + 1)

    @classmethod
    def from_model(cls, model: DecoderLM, tokenizer=None, draft: str | None = _USE_DEFAULT, *, name: str = "custom",
                   **kwargs) -> "LLM":
        """An LLM around `model`, a `DecoderLM` already loaded (`load_model`, another LLM's `.model`) or built,
        which is used as it is, not copied or loaded again; several LLMs may share one, e.g. a target under
        different drafts. `tokenizer` (optional: without one, prompts must be token ids) is the model's.

        `name` labels the model (`model_name`) and picks the default draft as `LLM(name)` would: the
        per-device default for the default model, none for any other. `kwargs` are `LLM()`'s: pass the
        `dtype` and `device` the model was built with (draft models are loaded with them). `quantization`
        cannot change a model already loaded, except "int8", which quantizes a copy (the caller's model stays
        dense); "auto" (the default) or the format the model has ("none" for a dense one) keeps it as it is;
        any other is an error."""
        return cls(name, draft, _loaded=(model, tokenizer), **kwargs)

    # -- prompts ---------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: pass token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use generate() with a plain prompt")
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- generation ------------------------------------------------------------------------------
    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([self.encode(p) for p in prompts], list(prompts), sampling_params, use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.apply_chat_template(c) for c in conversations]
        return self._run(ids, [None] * len(ids), sampling_params, use_tqdm)

    def _run(self, prompt_ids: list[list[int]], prompts: list, params, use_tqdm: bool) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompt_ids)
        if len(plist) != len(prompt_ids):
            raise InvalidRequestError(f"{len(plist)} sampling params for {len(prompt_ids)} prompts")
        for ids, p in zip(prompt_ids, plist):  # all of them first: a bad k-th prompt queues none
            self.engine.check_request(ids, p)
        reqs = []
        try:
            reqs.extend(self.engine.add_request(ids, p) for ids, p in zip(prompt_ids, plist))
            return self._collect(reqs, prompts, use_tqdm)
        finally:  # an exception or Ctrl-C mid-call must not leave its requests to run in the next call
            for r in reqs:
                self.engine.abort(r.request_id)

    def _collect(self, reqs: list, prompts: list, use_tqdm: bool) -> list[RequestOutput]:
        """Step the engine until every request of `reqs` finished; their outputs in order."""
        order = {r.request_id: i for i, r in enumerate(reqs)}
        results: list[RequestOutput | None] = [None] * len(reqs)
        bar = tqdm(total=len(reqs), desc="generating", unit="req", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    out.prompt = prompts[order[out.request_id]]
                    results[order[out.request_id]] = out
                    bar.update(1)
        bar.close()
        return results  # type: ignore[return-value]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[tuple[str, RequestOutput]]:
        """Yield (new text, output so far) as tokens arrive; holds back incomplete UTF-8 characters.

        Closing the generator early (`close()`, `break` out of a for loop, dropping it) aborts the
        request, which would otherwise stay queued and run in the next call."""
        ids = self.apply_chat_template([{"role": "user", "content": prompt}]) if chat else self.encode(prompt)
        req = self.engine.add_request(ids, params or SamplingParams())
        try:
            yield from self._stream(req)
        finally:
            self.engine.abort(req.request_id)

    def _stream(self, req) -> Iterator[tuple[str, RequestOutput]]:
        sent = ""
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id != req.request_id:
                    continue
                text = out.text if out.finished else out.text.rstrip("\ufffd")
                if len(text) > len(sent) or out.finished:
                    yield text[len(sent):], out
                    sent = text
                if out.finished:
                    return

    def aggregate_stats(self) -> dict:
        return self.engine.stats.as_dict()

