"""Family defaults for the width cap, the single-sequence hard limit, MoE detection, and what
`gmlx doctor` reports about a model's drafter and cap (pure and fast, plus tiny models)."""

from __future__ import annotations

import pytest
from mlx_lm.models import deepseek_v3, llama, mixtral, qwen3, qwen3_moe, qwen3_next
from typer.testing import CliRunner

from gmlx.policy import caps
from gmlx.models.family import default_cap, is_moe, single_sequence_limit
from native_checkpoints import DS_CONFIG, QN_CONFIG, QWEN3_CONFIG, deepseek_checkpoint, qwen3_next_checkpoint


@pytest.mark.parametrize("kind,moe,config_cap,cap,source", [
    ("mtp", False, 4, 4, "model default"),                          # the embedded model keeps its measured cap
    ("native-mtp:deepseek_v3", True, 3, 3, "model default"),        # a config value beats every family rule
    ("native-mtp:deepseek_v3", False, None, 0, "family default: dense target with an MTP head"),
    ("mtp", False, None, 0, "family default: dense target with an MTP head"),
    ("native-mtp:qwen3_next", True, None, 1, "family default: routed-expert (MoE) target"),
    ("draft-model", True, None, 1, "family default: routed-expert (MoE) target"),
    ("draft-model", False, None, 2, "family default: draft model drafter"),
    ("assistant", False, None, 2, "family default: assistant drafter"),
    (None, True, None, 0, "built-in default"),
    ("mtp", False, "off", "off", "model default"),
])
def test_default_cap(kind, moe, config_cap, cap, source):
    assert default_cap(kind, moe, config_cap) == (cap, source)


def _resolve(tmp_path, **kw):
    base = dict(cli_cap=None, env_cap=None, model_key="m", model_default=None, machine="x",
                path=tmp_path / "none.toml")
    return caps.resolve_cap(**{**base, **kw})


def test_resolve_cap_names_the_model_default_source(tmp_path):
    d = _resolve(tmp_path, model_default=1, model_default_source="family default: routed-expert (MoE) target")
    assert (d.cap, d.source, d.notice) == (1, "family default: routed-expert (MoE) target", None)
    assert _resolve(tmp_path, model_default=4).source == "model default"


@pytest.mark.parametrize("setting,expect_notice", [
    (dict(cli_cap=8), True), (dict(env_cap=0), True), (dict(model_default=0), True),
    (dict(cli_cap=1), False), (dict(cli_cap="off"), False)])
def test_single_sequence_drafter_is_a_hard_limit(tmp_path, setting, expect_notice):
    limit, why = single_sequence_limit("draft-model", single_sequence=True)
    assert (limit, why) == (1, "the draft-model drafter serves one sequence at a time")
    d = _resolve(tmp_path, hard_limit=limit, hard_limit_reason=why, **setting)
    if setting.get("cli_cap") == "off":
        assert d.cap is None and d.notice is None  # off is already below the limit
    else:
        assert d.cap == 1 and d.allows(1) and not d.allows(2)
    assert (d.notice is not None) == expect_notice
    if expect_notice:
        assert d.source.startswith("hard limit: ") and "no setting can raise it" in d.notice and why in d.notice
    assert single_sequence_limit("mtp", single_sequence=False) == (None, "")


def _small(module, config: dict, **over):
    return module.Model(module.ModelArgs.from_dict({**config, **over}))


LLAMA = {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5, "vocab_size": 64}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
QMOE = {**QWEN3_CONFIG, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}


@pytest.mark.parametrize("make,moe", [
    (lambda: _small(llama, LLAMA), False),
    (lambda: _small(qwen3, QWEN3_CONFIG), False),
    (lambda: _small(mixtral, {**LLAMA, "model_type": "mixtral", **MOE}), True),
    (lambda: _small(qwen3_moe, QMOE), True),
    (lambda: _small(deepseek_v3, DS_CONFIG, num_hidden_layers=2, first_k_dense_replace=1), True),
    (lambda: _small(deepseek_v3, DS_CONFIG, num_hidden_layers=2, n_routed_experts=None), False),
    (lambda: _small(qwen3_next, QN_CONFIG), True),
])
def test_is_moe_from_the_loaded_modules(make, moe):
    assert is_moe(make()) is moe


# -- gmlx doctor -------------------------------------------------------------------------------
def _doctor(model) -> str:
    from gmlx_cli import app as app_mod

    runner = CliRunner()
    with runner.isolation() as (out, err, _):
        try:
            app_mod.main(["doctor", "--model", str(model)])
        except SystemExit as e:
            assert e.code == 0, err.getvalue().decode()
        return out.getvalue().decode()


def test_doctor_reports_drafter_kind_and_cap_source(tmp_path, monkeypatch):
    monkeypatch.setenv("GMLX_CONFIG", str(tmp_path / "gmlx.toml"))
    monkeypatch.delenv("GMLX_MTP_WIDTH_CAP", raising=False)
    ds, _ = deepseek_checkpoint(tmp_path / "ds")
    out = _doctor(ds)
    assert "native-mtp:deepseek_v3" in out and "dense, hidden post_norm" in out
    assert "0 = uncapped (family default: dense target with an MTP head)" in out
    qn, _, _ = qwen3_next_checkpoint(tmp_path / "qn")
    out = _doctor(qn)
    assert "native-mtp:qwen3_next" in out and "unused" not in out  # a hybrid target speculates
    assert "hybrid: 3 of 4 layers recurrent (Qwen3NextGatedDeltaNet)" in out
    assert "routed-expert (MoE)" in out and "1 (family default: routed-expert (MoE) target)" in out
