"""Training data: the target's greedy continuations of a prompt set, saved as JSONL so runs resume.

One line per prompt: {"id", "prompt_ids", "continuation_ids", "text"}. Lines are appended after
every generation chunk; an interrupted run regenerates only the prompts without a line (a torn last
line is ignored). Token ids are stored, so training never re-tokenizes and the file stays valid for
any draft that shares the target's tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specfleet.errors import SpecfleetError
from specfleet.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Example:
    id: str
    prompt_ids: list[int]
    continuation_ids: list[int]  # the target's greedy output, EOS included when it stopped
    text: str = ""  # the continuation decoded, for people reading the file


@dataclass(frozen=True)
class Sequence:
    """One training row: prompt (left-truncated to fit) + continuation."""

    id: str
    input_ids: list[int]
    loss_start: int  # first position whose next token is a continuation token

    @property
    def num_targets(self) -> int:
        return len(self.input_ids) - 1 - self.loss_start


def read_continuations(path: Path) -> list[Example]:
    if not path.is_file():
        return []
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(Example(**json.loads(line)))
        except (ValueError, TypeError) as e:
            if i == len(lines) - 1:  # a line torn by an interrupted write: regenerate that prompt
                logger.warning("ignoring an incomplete last line in %s", path)
                break
            raise SpecfleetError(f"{path}, line {i + 1}: not a continuation record ({e}); "
                                 "expected JSON with id, prompt_ids, continuation_ids") from e
    return out


def append_continuations(path: Path, examples: list[Example]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    _drop_torn_tail(path)
    with open(path, "a", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(asdict(ex)) + "\n")
        f.flush()


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line that an interrupted write left without its newline, so appends start clean."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def generate_continuations(llm, prompts: list[tuple[str, list[int]]], max_new_tokens: int, path: Path,
                           chunk_size: int = 16) -> list[Example]:
    """Greedy continuations of (id, prompt_ids) by `llm` (a specfleet LLM without a draft), in
    prompt order; reuses records already in `path` (`llm` may be None when all are there) and
    appends the new ones chunk by chunk."""
    done = {ex.id: ex for ex in read_continuations(path)}
    todo = [(pid, ids) for pid, ids in prompts if pid not in done]
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="teacher continuations", unit="prompt")
    for start in range(0, len(todo), chunk_size):
        chunk = todo[start:start + chunk_size]
        outs = llm.generate([ids for _, ids in chunk], params)
        new = [Example(pid, ids, list(o.token_ids), o.text) for (pid, ids), o in zip(chunk, outs)]
        append_continuations(path, new)
        done.update((ex.id, ex) for ex in new)
        bar.update(len(chunk))
    bar.close()
    return [done[pid] for pid, _ in prompts]


def split_heldout(examples: list[Example], num_heldout: int) -> tuple[list[Example], list[Example]]:
    """(train, held-out): held-out examples are chosen among those with a continuation by a hash of
    the id, so the choice does not depend on file order and a resumed run holds out the same ones."""
    candidates = [ex for ex in examples if ex.continuation_ids]
    if num_heldout >= len(candidates):
        raise SpecfleetError(f"{len(candidates)} continuations cannot spare {num_heldout} for held-out evaluation; "
                             "use more prompts or a smaller --num-heldout")
    ranked = sorted(candidates, key=lambda ex: hashlib.sha1(ex.id.encode()).hexdigest())
    held = {ex.id for ex in ranked[:num_heldout]}
    return [ex for ex in examples if ex.id not in held], [ex for ex in examples if ex.id in held]


def to_sequences(examples: list[Example], max_seq_len: int, all_positions: bool = False) -> list[Sequence]:
    """Prompt + continuation, keeping the last prompt tokens when the row would exceed `max_seq_len`
    (the draft needs recent context most). The loss covers the continuation, or with `all_positions`
    every position (labelled by the teacher, see teacher.py); rows with nothing to learn are dropped."""
    out = []
    for ex in examples:
        cont = ex.continuation_ids[:max_seq_len - 1]
        prompt = ex.prompt_ids[-(max_seq_len - len(cont)):]
        seq = Sequence(ex.id, prompt + cont, 0 if all_positions else len(prompt) - 1)
        if seq.num_targets > 0:
            out.append(seq)
    return out


def select_vocab(examples: list[Example], k: int, vocab_size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The K token ids the reduced head predicts, sorted: `always` (EOS), then by frequency in the
    continuations, then in the prompts, then the lowest ids (byte-level BPE numbers merges in the
    order it learned them, so low ids are the frequent ones)."""
    cont = Counter(t for ex in examples for t in ex.continuation_ids)
    prompt = Counter(t for ex in examples for t in ex.prompt_ids)
    chosen = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))
    seen = set(chosen)
    ranked = sorted(set(cont) | set(prompt), key=lambda t: (-cont[t], -prompt[t], t))
    for t in ranked + list(range(vocab_size)):
        if len(chosen) >= k:
            break
        if t not in seen:
            chosen.append(t)
            seen.add(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def make_batches(seqs: list[Sequence], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices of `seqs` grouped by length so padding stays small (each batch holds at most
    `batch_tokens` padded tokens, at least one row), in an order shuffled per (seed, epoch)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].input_ids))
    batches, cur = [], []
    for i in order:
        longest = len(seqs[i].input_ids)  # rows are sorted, so the newest is the longest
        if cur and (len(cur) + 1) * longest > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(seed * 1_000_003 + epoch).shuffle(batches)
    return batches


def collate(seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, T] right-padded with 0, labels [B, T] = next token, mask [B, T] of the
    positions that predict a continuation token)."""
    t = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, :len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[r, s.loss_start:len(s.input_ids) - 1] = True
    labels = torch.zeros_like(ids)
    labels[:, :-1] = ids[:, 1:]
    return ids, labels, mask
