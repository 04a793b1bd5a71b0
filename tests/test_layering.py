"""The package's layers hold in its imports: no cycles, and imports only go down (tools/import_graph.py)."""
import importlib.util
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "import_graph.py"


def _tool():
    spec = importlib.util.spec_from_file_location("import_graph", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_cycles_and_imports_only_go_down():
    tool = _tool()
    file_graph, pkg_graph = tool.build()
    assert tool.strongly_connected(file_graph) == []
    assert tool.strongly_connected(pkg_graph) == []
    assert tool.layer_violations(file_graph) == []
    # every package is placed in a layer, so a new one cannot slip past the check
    assert set(pkg_graph) <= set(tool.RANK)


def test_the_check_catches_an_upward_import():
    tool = _tool()
    graph = {"specfleet.runtime.step.runner": {"specfleet.engine.scheduler"},
             "specfleet.engine.scheduler": set()}
    assert tool.layer_violations(graph) == [
        "specfleet.runtime.step.runner -> specfleet.engine.scheduler: specfleet.runtime may not import specfleet.engine"]
    assert tool.strongly_connected({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]


def test_the_model_imports_no_backend():
    """The room rule: runtime.model computes through routes bound by runtime.backends.bind, never by importing
    a backend itself; the check catches such an import."""
    tool = _tool()
    graph = {"specfleet.runtime.model.decoder": {"specfleet.runtime.backends.cuda.kernels", "specfleet.runtime.config"},
             "specfleet.runtime.backends.cuda.kernels": set(), "specfleet.runtime.config": set()}
    assert tool.layer_violations(graph) == [
        "specfleet.runtime.model.decoder -> specfleet.runtime.backends.cuda.kernels: specfleet.runtime.model may "
        "not import specfleet.runtime.backends"]
    file_graph, _ = tool.build()
    model_files = [m for m in file_graph if m.startswith("specfleet.runtime.model.")]
    assert len(model_files) >= 3  # decoder, config, attention: the rule has something to hold
