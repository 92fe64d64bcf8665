"""Integration tests with the real client libraries (Lightning, Hugging Face Trainer/Accelerate).

They run in one ordinary pytest process; each flow script runs on 2 ranks under torchrun in a
subprocess (free port, time limit, its own process group), once with our runtime and, where the
test says so, once with upstream's (DEEPSPEED_ZERO3=0). Results come back as JSON files.

With ZERO3_INTEGRATION_AGAINST_UPSTREAM=1 the checks meant for our runtime run against upstream.

They need the libraries in tests/integration/requirements.txt: `make test-integration` installs
them into .venv. Without them, the whole directory is skipped.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import AGAINST_UPSTREAM, launch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    missing = [name for name in ("lightning", "transformers", "accelerate", "deepspeed")
               if not _importable(name)]
    if missing:
        skip = pytest.mark.skip(reason=f"needs {', '.join(missing)} (tests/integration/requirements.txt): "
                                       "run `make test-integration`")
        for item in items:
            if HERE in Path(str(item.fspath)).resolve().parents:
                item.add_marker(skip)


def _importable(name):
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="session")
def launches(tmp_path_factory):
    """Launches are expensive (~30 s each on 2 cores): each is run once per session and shared."""
    cache = {}

    def get(script, flows, upstream):
        key = (script, tuple(flows), upstream)
        if key not in cache:
            name = f"{Path(script).stem}-{'upstream' if upstream else 'overlay'}-{len(cache)}"
            cache[key] = launch(script, flows, tmp_path_factory.mktemp(name), upstream)
        return cache[key]

    return get


@pytest.fixture
def needs_both_runtimes():
    if AGAINST_UPSTREAM:
        pytest.skip("compares upstream with our runtime; ZERO3_INTEGRATION_AGAINST_UPSTREAM=1 runs only upstream")
