"""Training data for a feature-conditioned draft head: the target's own hidden features on offline text.

For every token t_i of a text window the target's forward gives f_i, its final hidden state (after the
final norm, the row its head reads), and y_i = argmax of its logits (the token greedy decoding would put
at i + 1). A head learns to predict y_{i+1} and f_{i+1} from (f_i, t_{i+1}) (drafting/head.py).

Sources, all on this machine and none scored by a benchmark:
- `code`: the Python standard library's own sources (the interpreter's lib folder, without site-packages,
  so no benchmark package can slip in);
- `chat`: ShareGPT conversations (human and gpt turns, through the target's chat template) taken after
  the first EXCLUDE_SHAREGPT of the benchmark's seed-0 shuffle, so no prompt that a preset draws is seen.
HumanEval is never read.

Stored compactly and resumably: shards of about `shard_tokens` tokens, each a torch file holding
tokens (int32), labels (int32), features (fp16) and window lengths, plus manifest.json counting the
windows done; a rerun skips them (the window stream is deterministic for a seed).
"""
from __future__ import annotations

import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

logger = logging.getLogger(__name__)
EXCLUDE_SHAREGPT = 2000  # the bench draws its ShareGPT prompts from the head of the seed-0 shuffle


def stdlib_files() -> list[Path]:
    """The interpreter's own .py sources (its lib folder, not site-packages), in a fixed order."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files)


def code_windows(tokenizer, window: int, seed: int) -> Iterator[list[int]]:
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 200:
            continue
        ids = tokenizer.encode(text, add_special_tokens=False)
        for s in range(0, len(ids) - 32, window):
            yield ids[s:s + window]


def chat_windows(tokenizer, window: int, seed: int) -> Iterator[list[int]]:
    from specfleet.bench.datasets import DATASETS, data_file, iter_json_array

    try:
        path = data_file(DATASETS["sharegpt"])
    except Exception as e:  # noqa: BLE001 - an optional source
        logger.warning("no ShareGPT data (%s); chat windows skipped", e)
        return
    from specfleet.bench.datasets import read_sharegpt

    # the benchmark shuffles read_sharegpt's prompts with seed 0 and draws from the head: skip that head
    bench_order = list(read_sharegpt(path))
    random.Random(0).shuffle(bench_order)
    excluded = {p.prompt_id for p in bench_order[:EXCLUDE_SHAREGPT]}
    records = [r for r in iter_json_array(path) if isinstance(r, dict) and str(r.get("id", "")) not in excluded]
    rest = list(range(len(records)))
    random.Random(seed).shuffle(rest)
    for i in rest:
        turns = records[i].get("conversations") or []
        msgs = []
        for t in turns[:4]:
            role = {"human": "user", "gpt": "assistant"}.get(t.get("from"))
            if role is None or not (t.get("value") or "").strip():
                break
            msgs.append({"role": role, "content": t["value"]})
        if len(msgs) < 2:
            continue
        try:
            ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        except Exception:  # noqa: BLE001 - a malformed record
            continue
        if hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if len(ids) >= 64:
            yield list(ids[:window])


def mixed_windows(tokenizer, window: int, seed: int, code_share: float = 0.75) -> Iterator[list[int]]:
    """Code and chat windows interleaved, about `code_share` of them code."""
    code, chat = code_windows(tokenizer, window, seed), chat_windows(tokenizer, window, seed)
    rng = random.Random(seed + 1)
    sources = [code, chat]
    while sources:
        src = sources[0] if len(sources) == 1 else (code if rng.random() < code_share else chat)
        try:
            yield next(src)
        except StopIteration:
            sources.remove(src)


@dataclass
class Extractor:
    """Runs the target over windows, returning (features fp16, labels) for every row."""

    model: object
    window: int = 512
    chunk: int = 128

    def __post_init__(self):
        from specfleet.runtime.kv.blocks import BlockManager
        from specfleet.runtime.kv.cache import KVCache
        from specfleet.runtime.step.runner import ModelRunner

        block = 16
        nblocks = (self.window + block - 1) // block + 1
        dtype = next(self.model.parameters()).dtype
        self.blocks = BlockManager(nblocks, block)
        self.runner = ModelRunner(self.model, KVCache.allocate(self.model.config, nblocks, block, dtype, "cpu"),
                                  torch.device("cpu"))
        self.runner.keep_hidden = True

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        from specfleet.runtime.step.runner import ForwardItem

        rid = "extract"
        ids = ids[:self.window]
        assert self.blocks.reserve(rid, len(ids))
        feats, labels = [], []
        try:
            for s in range(0, len(ids), self.chunk):
                part = ids[s:s + self.chunk]
                logits = self.runner.execute([ForwardItem(rid, part, s, list(range(len(part))))], self.blocks)
                labels.append(logits.argmax(-1).to(torch.int32))
                feats.append(self.runner.last_hidden.to(torch.float16))
        finally:
            self.blocks.free(rid)
        return torch.cat(feats), torch.cat(labels)


def extract(model, tokenizer, out: Path, max_tokens: int, window: int = 512, seed: int = 0,
            shard_tokens: int = 8192, time_budget_s: float | None = None, windows: Iterator[list[int]] | None = None,
            progress: bool = True) -> dict:
    """Extract features into `out` until it holds `max_tokens` tokens (or the time budget ends); resumes."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else \
        {"windows": 0, "tokens": 0, "shards": [], "seed": seed, "window": window, "seconds": 0.0}
    if manifest["tokens"] >= max_tokens:
        return manifest
    stream = windows if windows is not None else mixed_windows(tokenizer, window, manifest["seed"])
    for _ in range(manifest["windows"]):  # the deterministic stream: skip what earlier runs did
        next(stream, None)
    ex = Extractor(model, window)
    buf: dict[str, list] = {"tokens": [], "labels": [], "feats": [], "lengths": []}
    t0 = time.perf_counter()
    bar = tqdm(total=max_tokens, initial=manifest["tokens"], unit="tok", desc="features", disable=not progress,
               file=sys.stderr, smoothing=0.05)

    def flush() -> None:
        if not buf["lengths"]:
            return
        name = f"shard_{len(manifest['shards']):05d}.pt"
        torch.save({"tokens": torch.cat(buf["tokens"]), "labels": torch.cat(buf["labels"]),
                    "feats": torch.cat(buf["feats"]), "lengths": torch.tensor(buf["lengths"])}, out / name)
        manifest["shards"].append(name)
        manifest["windows"] += len(buf["lengths"])
        manifest["tokens"] += sum(buf["lengths"])
        manifest["seconds"] += time.perf_counter() - flush.t
        flush.t = time.perf_counter()
        tmp = manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        tmp.replace(manifest_path)
        for v in buf.values():
            v.clear()

    flush.t = t0
    done = manifest["tokens"]
    for ids in stream:
        if done >= max_tokens or (time_budget_s is not None and time.perf_counter() - t0 > time_budget_s):
            break
        feats, labels = ex(ids)
        n = feats.shape[0]
        buf["tokens"].append(torch.tensor(ids[:n], dtype=torch.int32))
        buf["labels"].append(labels)
        buf["feats"].append(feats)
        buf["lengths"].append(n)
        done += n
        bar.update(n)
        if sum(buf["lengths"]) >= shard_tokens:
            flush()
    flush()
    bar.close()
    return manifest


def load_shards(folder: Path, max_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Every shard of `folder` concatenated (up to `max_tokens` tokens, whole windows)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    parts: dict[str, list] = {"tokens": [], "labels": [], "feats": [], "lengths": []}
    total = 0
    for name in manifest["shards"]:
        d = torch.load(folder / name, weights_only=True)  # tensors only: never code from a data file
        for k in parts:
            parts[k].append(d[k])
        total += int(d["lengths"].sum())
        if max_tokens is not None and total >= max_tokens:
            break
    return {k: torch.cat(v) for k, v in parts.items()}


def humaneval_eval_set(model, tokenizer, out: Path, num_prompts: int = 20, max_new_tokens: int = 64) -> Path:
    """EVALUATION ONLY (never a training source): the first `num_prompts` HumanEval prompts (raw, as the
    fleet preset runs them) with the target's greedy continuations, their features and labels, in `out`
    (same shard format; manifest also records where each continuation starts)."""
    from specfleet.bench.datasets import iter_prompts, select
    from specfleet.llm import LLM
    from specfleet.sampling_params import SamplingParams

    if (out / "manifest.json").is_file():
        return out
    prompts = select(iter_prompts("humaneval")[0], num_prompts)
    ids = [tokenizer.encode(p.text, add_special_tokens=True) for p in prompts]
    llm = LLM.from_model(model, tokenizer, draft=None)
    outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=max_new_tokens))
    seqs = [i + list(o.token_ids) for i, o in zip(ids, outs)]
    out.mkdir(parents=True, exist_ok=True)
    manifest = extract(model, tokenizer, out, sum(map(len, seqs)), window=1024, windows=iter(seqs), progress=False)
    manifest["continuation_starts"] = [len(i) for i in ids]
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def token_counts(tokenizer, max_files: int | None = None, seed: int = 0) -> "Counter":
    """Token frequencies over the standard library's sources (tokenizing only: cheap), to choose a head's
    reduced vocabulary from far more text than the features cover. (With the vocabulary chosen from 8k
    feature tokens, 9.3 % of the 1.5B's greedy tokens on HumanEval fell outside it.)"""
    from collections import Counter

    files = stdlib_files()
    random.Random(seed).shuffle(files)
    counts: Counter = Counter()
    for path in files[:max_files]:
        try:
            counts.update(tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False))
        except (OSError, UnicodeDecodeError):
            continue
    return counts
