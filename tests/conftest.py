import os

import gmlx  # noqa: F401  (loads OpenBLAS before mlx)
import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=20, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


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
