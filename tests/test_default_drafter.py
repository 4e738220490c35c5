"""A model's config.json may name its default drafter (`speculative_drafter`): the embedded model
names its assistant head, measured faster than its MTP head; its measured cap and K, and the cap
that sweep-cap calibrates under the plain model key, belong to that drafter."""

import gmlx  # noqa: F401  (loads OpenBLAS before mlx.core)

import json
import os
import shutil

import pytest
from engine_helpers import P, check_solo, drive

from gmlx.config import EngineConfig
from gmlx.drafters.select import cap_key_suffix, choose, default_kind
from gmlx.engine import Engine
from gmlx.errors import ModelLoadError
from gmlx.models.loading import load


def _copy(src, dst, drop=(), **config):
    """The model directory as hard links, without the files starting with `drop`, config.json
    updated with `config`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("draft", "eagle3", *(f"{d}*" for d in drop)),
                    copy_function=os.link)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").unlink()  # a hard link: write a new file, never into the shipped one
    (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def test_the_embedded_model_drafts_with_its_assistant_head_by_default(lm):
    assert lm.default_drafter == "assistant" and default_kind(lm) == "assistant"
    own = choose(lm, EngineConfig())
    assert own.drafter.kind == "assistant" and own.cap_key_suffix == ""  # sweep-cap's plain key is its
    assert own.cap_defaults["model_default"] == lm.config["speculative_width_cap"]  # measured with it
    mtp = choose(lm, EngineConfig(drafter="mtp"))
    assert mtp.drafter.kind == "mtp" and mtp.cap_key_suffix == "+mtp"
    assert mtp.cap_defaults["model_default"] == 0  # the family default for a dense target's MTP head
    assert cap_key_suffix(mtp.drafter) == ""  # a model that names none: its MTP head keeps the plain key


def test_the_default_assistant_streams_equal_plain_decoding(lm, prompts):
    """The user's default engine (no drafter asked for), alone, batched, greedy and seeded."""
    eng = Engine(lm, EngineConfig(width_cap=0))
    assert eng.drafter.kind == "assistant"
    run = drive(eng, {0: [("alone", prompts[4], P(24))],
                      2: [("b", prompts[5], P(20, seed=3, t=0.8)), ("c", prompts[6], P(20))]})
    check_solo(lm, run)
    recs = [s.result for s in run.streams.values()]
    assert sum(r.stats["num_accepted"] for r in recs) > 0
    eng.close()


def test_a_copy_without_the_named_drafter_falls_back_to_the_mtp_head(lm, tmp_path):
    copy = load(_copy(lm.path, tmp_path / "m", drop=("assistant_",)))
    assert copy.default_drafter == "assistant" and default_kind(copy) == "mtp"
    choice = choose(copy, EngineConfig())
    assert choice.drafter.kind == "mtp" and choice.cap_key_suffix == ""
    assert choice.cap_defaults["model_default"] == lm.config["speculative_width_cap"]


def test_an_unknown_drafter_name_is_a_load_error_naming_the_key(lm, tmp_path):
    with pytest.raises(ModelLoadError, match="speculative_drafter must be one of mtp, assistant, ngram"):
        load(_copy(lm.path, tmp_path / "m", speculative_drafter="medusa"))
