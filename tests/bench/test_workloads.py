"""The workload prompt sets of issue 43 (bench/datasets.py) on their real data: code edits of the running
interpreter's standard library files, later ShareGPT turns with the earlier ones as context, BFCL tool-call
loops (skipped without bfcl-eval, unless SPECFLEET_REQUIRE_REAL=1; install it with
`pip install --no-deps bfcl-eval==2026.3.23`), the workloads preset, and llama-server's speculation options.
No model runs except SmolLM2's tokenizer rendering a tool loop."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from specfleet.bench import datasets, llamacpp, presets, runner
from specfleet.bench.systems import SystemSpec, parse_system
from specfleet.errors import SpecfleetError

from tests.bench.test_datasets import require_dataset


# -- code edits ------------------------------------------------------------------------------------------
def test_code_edits_hold_the_whole_real_file_and_are_deterministic():
    first = list(datasets.iter_prompts("code-edit")[0])
    again = list(datasets.iter_prompts("code-edit")[0])
    assert first == again and len(first) >= 8
    files = datasets.stdlib_sources()
    assert [p.prompt_id.split(":")[0] for p in first] == [f.name for f in files]
    tasks = {p.prompt_id.split(":")[1] for p in first}
    assert tasks == set(datasets.CODE_EDIT_TASKS)
    for prompt, path in zip(first, files):
        source = path.read_text(encoding="utf-8")
        assert 60 <= source.count("\n") <= 200
        assert source.rstrip() in prompt.text  # the whole file, as it is on disk
        assert prompt.as_messages() == [{"role": "user", "content": prompt.text}]
        assert prompt.text.startswith(path.name + "\n```python\n") and "Reply with the whole edited file" in prompt.text
        # the request before it in an editor session: the same file under another of the edits
        earlier = prompt.previous_prompt()
        assert earlier.prompt_id == prompt.prompt_id + ":previous" and earlier.text != prompt.text
        cut = prompt.text.index(source.rstrip()) + len(source.rstrip())
        assert earlier.text[:cut] == prompt.text[:cut] and earlier.messages == (("user", earlier.text),)
        assert earlier.text.endswith("Reply with the whole edited file in one code block and nothing else.")


def test_rename_names_a_symbol_the_file_defines_and_uses():
    renames = [p for p in datasets.iter_prompts("code-edit")[0] if p.prompt_id.endswith(":rename")]
    assert renames
    for p in renames:
        old, new = re.search(r"Rename `(\w+)` to `(\w+)`", p.text).groups()
        source = (datasets.stdlib_dir() / p.prompt_id.split(":")[0]).read_text(encoding="utf-8")
        tree = ast.parse(source)
        assert old in {n.name for n in tree.body if hasattr(n, "name")}
        assert len(re.findall(rf"\b{old}\b", source)) >= 2 and new not in source and new != old


def test_rename_rules_and_file_filter(tmp_path):
    src = "def _get_sep(p):\n    return p\n\nclass Thing:\n    pass\n\nx = _get_sep(Thing())\n"
    assert datasets.rename_target(src) == ("_get_sep", "_getSep")
    assert datasets.rename_target("class Node:\n    pass\n\nNode()\n") == ("Node", "NodeRenamed")
    assert datasets.rename_target("def f():\n    pass\n") is None  # defined, never used
    (tmp_path / "ok.py").write_text("def used():\n    pass\n" + "used()\n" * 60)
    (tmp_path / "short.py").write_text("def used():\n    pass\nused()\n")
    (tmp_path / "broken.py").write_text("def (:\n" * 70)
    assert [p.name for p in datasets.stdlib_sources(folder=tmp_path)] == ["ok.py"]
    prompts = list(datasets.read_code_edits(folder=tmp_path))
    assert [p.prompt_id for p in prompts] == ["ok.py:rename"] and "Rename `used` to `renamed_used`" in prompts[0].text
    with pytest.raises(SpecfleetError, match="unknown code-edit task"):
        datasets.code_edit_prompt(tmp_path / "ok.py", "reformat")


# -- multi-turn chat -------------------------------------------------------------------------------------
def test_sharegpt_multiturn_rules(tmp_path):
    path = tmp_path / "s.json"
    h, g = (lambda v: {"from": "human", "value": v}), (lambda v: {"from": "gpt", "value": v})
    path.write_text(json.dumps([
        {"id": "one", "conversations": [h("hi"), g("hello")]},  # a single exchange: no later turn
        {"id": "two", "conversations": [h("a"), g("b"), h("c"), g("d"), h("e"), g("f")]},
        {"id": "open", "conversations": [h("a"), g("b"), h("c")]},  # the last turn was never answered
        {"id": "long", "conversations": [h("x" * 50), g("y"), h("z"), g("w")]},
    ]))
    got = list(datasets.read_sharegpt_multiturn(path, max_context_chars=40))
    assert [p.prompt_id for p in got] == ["two:t3"]
    assert got[0].messages == (("user", "a"), ("assistant", "b"), ("user", "c"), ("assistant", "d"), ("user", "e"))
    assert got[0].text == "e"
    assert got[0].previous == got[0].messages[:4]  # what the earlier turns leave in the cache: up to the answer "d"
    assert got[0].previous_prompt().as_messages() == [{"role": "user", "content": "a"},
                                                      {"role": "assistant", "content": "b"},
                                                      {"role": "user", "content": "c"},
                                                      {"role": "assistant", "content": "d"}]
    assert [p.prompt_id for p in datasets.read_sharegpt_multiturn(path, max_context_chars=3)] == ["two:t2"]


def test_real_sharegpt_multiturn_is_the_conversation_as_written():
    path = require_dataset("sharegpt-multiturn")
    raw = {}
    for record in datasets.iter_json_array(path):
        raw[record["id"]] = record
        if len(raw) > 400:
            break
    chosen = datasets.select(datasets.iter_prompts("sharegpt-multiturn")[0], 4, shuffle_seed=0)
    assert chosen == datasets.select(datasets.iter_prompts("sharegpt-multiturn")[0], 4, shuffle_seed=0)
    prompts = [p for _, p in zip(range(40), datasets.iter_prompts("sharegpt-multiturn")[0])]
    assert len(prompts) == 40 and all(p.prompt_id.split(":")[0] in raw for p in prompts)
    for p in prompts:
        turns = raw[p.prompt_id.split(":")[0]]["conversations"]
        n = len(p.messages)
        assert n >= 3 and n % 2 == 1 and p.messages[-1] == ("user", p.text)
        assert [c for _, c in p.messages] == [t["value"] for t in turns[:n]]  # verbatim, in order
        assert [r for r, _ in p.messages] == ["user", "assistant"] * (n // 2) + ["user"]
        assert turns[n]["from"] == "gpt"  # the model answered this turn in the data
        assert p.previous == p.messages[:-1] and p.previous[-1][0] == "assistant"


# -- tool-call loops (BFCL) ------------------------------------------------------------------------------
def test_parse_call_reads_literals_only():
    assert datasets.parse_call("mv(source='a.txt', destination='tmp')") == ("mv", [], {"source": "a.txt",
                                                                                     "destination": "tmp"})
    assert datasets.parse_call("sort('f.pdf')") == ("sort", ["f.pdf"], {})
    for bad in ("os.system('ls')", "f(x=open('y'))", "cd(", "1 + 2"):
        with pytest.raises(SpecfleetError, match="cannot read the BFCL call"):
            datasets.parse_call(bad)


def test_real_tool_loops_are_call_result_next_call():
    path = require_dataset("tool-loop")
    loops = list(datasets.iter_prompts("tool-loop")[0])
    assert loops == list(datasets.iter_prompts("tool-loop")[0]) and len(loops) >= 50
    answers = {}
    for line in open(path.parent / "possible_answer" / path.name, encoding="utf-8"):
        entry = json.loads(line)
        answers[entry["id"]] = entry["ground_truth"][0]
    for p in loops:
        qid, call = p.prompt_id.split(":")
        truth = answers[qid]
        assert call == f"call{len(truth)}" and len(truth) >= 2
        roles = [m[0] for m in p.messages]
        assert roles == ["user"] + ["assistant", "tool"] * (len(truth) - 1)  # call, result, ..., then the next call
        offered = {t["function"]["name"] for t in p.tool_list()}
        for k, text in enumerate(truth[:-1]):
            name, args, kwargs = datasets.parse_call(text)
            (made,) = json.loads(p.messages[1 + 2 * k][2])
            assert made["name"] == name and made["name"] in offered
            assert {k: made["arguments"][k] for k in kwargs} == kwargs  # the call's own arguments, by name
            assert list(made["arguments"].values())[:len(args)] == args and len(made["arguments"]) == len(args) + len(kwargs)
        assert datasets.parse_call(truth[-1])[0] in offered  # the call the model is to make is on offer
        # the earlier requests leave the conversation up to the last call in the cache, the same tools on offer
        assert p.previous == p.messages[:-1] and p.previous[-1][0] == "assistant" and p.previous_prompt().tools == p.tools
        assert all(t["function"]["parameters"].get("type") == "object" for t in p.tool_list())
    first = next(p for p in loops if p.prompt_id == "multi_turn_base_0:call3")
    # BFCL's simulated file system answered the real calls: cd into document, then mkdir temp
    assert first.messages[2] == ("tool", json.dumps({"current_working_directory": "document"}))
    assert json.loads(first.messages[3][2]) == [{"name": "mkdir", "arguments": {"dir_name": "temp"}}]


def test_tool_loop_renders_tools_calls_and_results_in_the_chat_template():
    from transformers import AutoTokenizer

    from specfleet.runtime.loading.checkpoint import tokenizer_folder
    from tests.conftest import real_model_path

    require_dataset("tool-loop")
    tok = AutoTokenizer.from_pretrained(tokenizer_folder(real_model_path("smollm2-135m-instruct")))
    tok.chat_template = (Path(__file__).parents[2] / "specfleet/server/templates/chatml_tools.jinja").read_text()
    loop = next(p for p in datasets.iter_prompts("tool-loop")[0] if p.prompt_id == "multi_turn_base_0:call3")
    text = tok.decode(runner.encode_prompt(loop, tok, chat=True))
    assert '"name": "mkdir"' in text and '"dir_name": "temp"' in text  # the calls made
    assert '{"current_working_directory": "document"}' in text  # their results
    for tool in loop.tool_list():  # the functions on offer
        assert tool["function"]["name"] in text
    assert text.rstrip().endswith("assistant") and loop.text in text


# -- the preset and llama-server's speculation -----------------------------------------------------------
def test_workloads_preset_runs_plain_default_and_both_llama_speculations():
    from specfleet.llm import DEFAULT_DRAFT

    preset = presets.get_preset("workloads")
    runner.validate(preset)
    assert [r.name for r in preset.runs] == ["code-edit", "chat", "tool-loop", "humaneval", "code-edit-warm",
                                             "chat-warm", "tool-loop-warm"]
    for r in preset.runs:
        cold = next(c for c in preset.runs if c.name == r.name.removesuffix("-warm"))
        assert r.loop == r.name.endswith("-warm") and replace(r, name=cold.name, loop=False) == cold
        assert r.systems[:2] == ("specfleet:none", f"specfleet:{DEFAULT_DRAFT['cpu']}")
        assert r.temperature == 0 and r.rounds >= 2 and r.batch_sizes == (1,) and r.quantization == "gguf"
        assert any(s.startswith("llamacpp:ngram-mod") for s in r.systems)
        assert any(s.startswith("llamacpp:draft-simple") and "qwen-0.5b" in s for s in r.systems)
        assert r.dataset in datasets.dataset_names()
    assert {c.part for c in preset.checks} == {r.name for r in preset.runs}
    code = next(r for r in preset.runs if r.name == "code-edit")
    chosen = datasets.select(datasets.iter_prompts("code-edit")[0], code.num_prompts, code.shuffle_seed)
    assert {p.prompt_id.split(":")[1] for p in chosen} == set(datasets.CODE_EDIT_TASKS)  # every kind of edit is timed


def test_llama_speculation_options():
    ngram = parse_system("llamacpp:ngram-mod")
    assert (ngram.kind, ngram.draft) == ("llamacpp", "ngram-mod")
    assert llamacpp.spec_args(ngram) == ["--spec-type", "ngram-mod"]
    assert llamacpp.spec_args(parse_system("llamacpp")) == []
    tuned = parse_system("llamacpp:ngram-mod,spec_ngram_mod_n_max=32")
    assert llamacpp.spec_args(tuned) == ["--spec-type", "ngram-mod", "--spec-ngram-mod-n-max", "32"]
    with pytest.raises(SpecfleetError, match="needs a draft model"):
        llamacpp.spec_args(parse_system("llamacpp:draft-simple"))
    with pytest.raises(SpecfleetError, match="--spec-type names"):
        parse_system("llamacpp:Draft Simple!")
    with pytest.raises(SpecfleetError, match="hf takes no draft"):
        parse_system("hf:qwen-0.5b")
    assert llamacpp.server_spec_counts(10, {"draft_n": 12, "draft_n_accepted": 5}) == {
        "steps": 4, "drafted": 12, "accepted": 5}  # 1 prefill token + 4 steps emitting 5 accepted + 4 own
    assert llamacpp.server_spec_counts(10, {}) == {"steps": 10, "drafted": 0, "accepted": 0}


def test_llama_speculation_is_skipped_without_a_native_server(monkeypatch):
    monkeypatch.setenv("LLAMA_SERVER", "/nonexistent/llama-server")
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not llamacpp.available(SystemSpec("llamacpp:ngram-mod", "llamacpp", "ngram-mod"))
