import os
import sys
from pathlib import Path

# OpenMP threads spin while waiting by default; on a shared 2-core CI machine that makes forward
# passes many times slower. Must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# The shared helpers (tiny_models, tiny_quant_models, tiny_engines, cuda_route) import by their bare names
# from any folder below. Test folders are packages (tests/<package>/__init__.py), so pytest names each test
# module by its path (tests.engine.test_distribution, tests.strategies.test_distribution): same-named files
# in two folders cannot clash, and a test module imports another's helpers as tests.<folder>.<module>.
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def real_model_path(name: str) -> Path | None:
    """The assembled file of an embedded model, or None (the test is skipped) when not installed.

    With SPECFLEET_REQUIRE_REAL=1 (set by .ci/run) a missing model fails instead of skipping.
    """
    from specfleet.errors import ModelLoadError
    from specfleet import registry

    try:
        return registry.resolve_model(name)
    except ModelLoadError as e:
        if os.environ.get("SPECFLEET_REQUIRE_REAL") == "1":
            raise
        pytest.skip(f"{name} not installed: {e}")


def optional_model_path(name: str) -> Path:
    """The assembled file of a real model that CI does not install (it installs SmolLM2 only), or a
    skip, even under SPECFLEET_REQUIRE_REAL=1."""
    from specfleet.errors import ModelLoadError
    from specfleet import registry

    try:
        return registry.resolve_model(name)
    except ModelLoadError as e:
        pytest.skip(f"{name} not installed (specfleet models install {name}): {e}")


@pytest.fixture(scope="session")
def smollm2_checkpoint():
    from specfleet.runtime.loading.checkpoint import load_checkpoint

    path = real_model_path("smollm2-135m-instruct")
    return load_checkpoint(path, torch.float32)



def _test_client_says_localhost() -> None:
    """Starlette's TestClient sends `Host: testserver`, a name a keyless server refuses (the DNS rebinding
    guard, server/auth.HostAllowlistMiddleware); the in-process tests talk as a local client would. A test
    of the guard passes its own base_url. Patched once, at import, so module-scoped clients get it too."""
    try:
        from starlette.testclient import TestClient
    except ImportError:
        return
    init = TestClient.__init__
    if getattr(init, "_says_localhost", False):
        return

    def local_init(self, app, base_url: str = "http://localhost", *args, **kwargs):
        init(self, app, base_url, *args, **kwargs)

    local_init._says_localhost = True
    TestClient.__init__ = local_init


_test_client_says_localhost()
