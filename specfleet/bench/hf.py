"""The transformers baselines: plain `generate` and assisted generation with the same draft.

Both read the same weights as specfleet (the HF-layout folder our loader converts GGUF files into)
and the same token ids. Per-request timings come from a stopping criterion that only reads the
clock: it records when the batch reached each length, and a row's finish time is the moment its
sequence first held its end token. Forward hooks count target passes and, for assisted
generation, time the draft and target forwards, so HF's acceptance can be reported in specfleet's
conventions (every assisted pass verifies a draft, so steps = target passes and mean accepted
length = output tokens / target passes).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from specfleet.bench.systems import Generation, Settings, SystemSpec
from specfleet.errors import SpecfleetError

PROMPT_LOOKUP_NAMES = {"prompt-lookup", "ngram", "lookup"}


def hf_folder(name: str, dtype: torch.dtype) -> Path:
    """The HF-layout folder of a registered model or path (a GGUF file is converted once, cached)."""
    from specfleet.registry import resolve_model
    from specfleet.runtime.loading.checkpoint import converted_folder

    path = resolve_model(name)
    return path if path.is_dir() else converted_folder(path, dtype)


def load_hf_model(name: str, dtype: torch.dtype, device: torch.device):
    """transformers' model for `name`; `NAME@N` keeps the first N layers, as specfleet's loader does."""
    from transformers import AutoModelForCausalLM

    base, _, layers = name.rpartition("@") if "@" in name else (name, "", "")
    model = AutoModelForCausalLM.from_pretrained(str(hf_folder(base, dtype)), dtype=dtype).to(device).eval()
    if layers:
        model.model.layers = model.model.layers[:int(layers)]
        model.config.num_hidden_layers = int(layers)
    return model


class _Clock:
    """A stopping criterion that never stops anything: it notes (generated length, time) per call."""

    def __init__(self, prompt_len: int, device: torch.device):
        self.prompt_len, self.device = prompt_len, device
        self.t0 = time.perf_counter()
        self.marks: list[tuple[int, float]] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.marks.append((input_ids.shape[1] - self.prompt_len, time.perf_counter() - self.t0))
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def time_at(self, length: int) -> float:
        return next((t for n, t in self.marks if n >= length), self.marks[-1][1] if self.marks else 0.0)


class _ForwardMeter:
    """Counts (and, if `timed`, times) a module's forward calls while installed."""

    def __init__(self, module: torch.nn.Module, device: torch.device, timed: bool):
        self.calls, self.seconds, self._start = 0, 0.0, 0.0
        self.device, self.timed = device, timed
        self._hooks = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _pre(self, *_):
        if self.timed:
            _sync(self.device)
            self._start = time.perf_counter()

    def _post(self, *_):
        self.calls += 1
        if self.timed:
            _sync(self.device)
            self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _effective_draft_settings(cfg) -> dict:
    """The draft settings transformers will use: the draft's own, else transformers' global defaults."""
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    defaults = cfg._get_default_generation_params() if hasattr(cfg, "_get_default_generation_params") else {}
    return {k: getattr(cfg, k, None) if getattr(cfg, k, None) is not None else defaults.get(k) for k in keys}


class HFSystem:
    """`hf` (draft None) or `hf-assisted:DRAFT`; `draft_model` is None for prompt lookup."""

    def __init__(self, spec: SystemSpec, model, draft_model, *, device: torch.device, spec_len: int,
                 pad_token_id: int, eos_token_ids: tuple[int, ...]):
        self.label, self.model, self.draft_model, self.device = spec.label, model, draft_model, device
        self.pad_token_id, self.eos_token_ids = pad_token_id, tuple(eos_token_ids)
        self.is_assisted = spec.kind == "hf-assisted"
        self.max_batch_size = 1 if self.is_assisted else None  # transformers assists batch size 1 only
        self.assist: dict = {}  # generate() keywords
        draft_settings: dict = {}  # transformers reads these from the draft model's own generation_config
        if self.is_assisted and draft_model is None:
            self.assist["prompt_lookup_num_tokens"] = int(spec.options.get("k", spec_len))
        elif self.is_assisted:
            self.assist["assistant_model"] = draft_model
            if "k" in spec.options:  # a fixed draft length instead of transformers' default heuristics
                draft_settings = {"num_assistant_tokens": int(spec.options["k"]),
                                  "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0}
        self.notes = {k: v for k, v in self.assist.items() if k != "assistant_model"}
        if draft_model is not None:
            self.notes |= _effective_draft_settings(draft_model.generation_config) | draft_settings

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], settings: Settings) -> list[Generation]:
        from transformers import StoppingCriteriaList

        if self.is_assisted and len(prompts) > 1:
            raise SpecfleetError("transformers assisted generation runs one prompt at a time")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as decoder-only batched generation needs
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kwargs = dict(max_new_tokens=settings.max_tokens, pad_token_id=self.pad_token_id,
                      eos_token_id=None if settings.ignore_eos else list(self.eos_token_ids), **self.assist)
        if settings.temperature > 0:
            kwargs |= dict(do_sample=True, temperature=settings.temperature, top_k=settings.top_k or None,
                           top_p=settings.top_p)
            torch.manual_seed(settings.seed)
        else:
            kwargs |= dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        if self.draft_model is not None:  # the draft model may be shared with another system: set, every call
            for key, value in self.notes.items():
                setattr(self.draft_model.generation_config, key, value)
        target = _ForwardMeter(self.model, self.device, timed=self.is_assisted)
        draft = _ForwardMeter(self.draft_model, self.device, True) if self.draft_model is not None else None
        try:
            _sync(self.device)
            clock = _Clock(width, self.device)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
            _sync(self.device)
            end = time.perf_counter() - clock.t0
        finally:
            target.remove()
            if draft is not None:
                draft.remove()
        gens = []
        for row in out[:, width:].tolist():
            n = self._output_length(row, settings.ignore_eos)
            first = min(n, clock.marks[0][0]) if clock.marks else 1  # an assisted first pass emits several
            gens.append(Generation(row[:n], clock.time_at(n) if n < len(row) else end, clock.time_at(1), first))
        if len(prompts) == 1:  # passes are per batch; only a lone request owns them all
            g = gens[0]
            g.spec = {"steps": target.calls, "accepted": max(0, len(g.output_ids) - target.calls),
                      "drafted": draft.calls if draft is not None else (None if self.is_assisted else 0)}
            if self.is_assisted:
                g.spec |= {"verify_time_s": target.seconds, "draft_time_s": draft.seconds if draft else None}
        return gens

    def _output_length(self, row: list[int], ignore_eos: bool) -> int:
        if not ignore_eos:
            for i, tok in enumerate(row):
                if tok in self.eos_token_ids:
                    return i + 1
        return len(row)

    def close(self) -> None:
        self.model = self.draft_model = None
