"""Load-time measurements kept across processes (gmlx/measured.py): what one process measured at load
(the round-cost probe, a quantized target's faster decode path, the twin's check) a later one reads
on the same model files, drafter weights, machine, software and switches, and measures again on any
other. The suite pins GMLX_KEEP_MEASURED=0 (conftest); here it is on, in a temporary cache."""

import os
import time
import warnings

import pytest

from gmlx import measured
from gmlx.decode import probe
from gmlx.drafters.select import select_drafter
from gmlx.errors import ModelLoadError
from gmlx.models import adapter, dequantized
from gmlx.models.loading import load


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """Measurements kept, in a cache of this test's own."""
    monkeypatch.setenv("GMLX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GMLX_KEEP_MEASURED", "1")
    return tmp_path / "cache" / "measured"


def test_kept_and_read_on_the_same_key_only(kept, monkeypatch):
    measured.keep("x", ["model", 3], {"v": 1})
    value, at = measured.recall("x", ["model", 3])
    assert value == {"v": 1} and time.time() - at < 60
    assert measured.recall("x", ["model", 2]) is None and measured.recall("y", ["model", 3]) is None
    monkeypatch.setenv("GMLX_COMPILE", "0")  # a switch that changes a forward: another key
    assert measured.recall("x", ["model", 3]) is None
    monkeypatch.delenv("GMLX_COMPILE")
    with monkeypatch.context() as m:  # another machine, another MLX, or gmlx's code changed: another key
        m.setattr(measured, "_machine_and_software", lambda real=measured._machine_and_software: {**real(), "code": "x"})
        assert measured.recall("x", ["model", 3]) is None
    assert measured.recall("x", ["model", 3])[0] == {"v": 1}
    monkeypatch.setenv("GMLX_KEEP_MEASURED", "0")  # off: nothing read, nothing written
    assert measured.recall("x", ["model", 3]) is None
    measured.keep("z", ["model"], 1)
    assert sorted(p.name.split("-")[0] for p in kept.iterdir()) == ["x"]


def test_an_old_or_cut_short_measurement_is_taken_again(kept, monkeypatch):
    measured.keep("x", ["m"], 1)
    (path,) = kept.iterdir()
    now = time.time()
    with monkeypatch.context() as later:
        later.setattr(measured.time, "time", lambda: now + measured.MAX_AGE + 1)
        assert measured.recall("x", ["m"]) is None  # older than MAX_AGE
    assert measured.recall("x", ["m"])[0] == 1
    path.write_text(path.read_text()[:20])  # a write cut short
    assert measured.recall("x", ["m"]) is None
    measured.keep("x", ["m"], 2)
    assert measured.recall("x", ["m"])[0] == 2


def test_a_cache_that_cannot_be_written_says_so_once(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GMLX_CACHE", str(tmp_path / "file"))  # a file where the directory would go
    monkeypatch.setenv("GMLX_KEEP_MEASURED", "1")
    monkeypatch.setattr(measured, "_said", False)
    with pytest.warns(RuntimeWarning, match="could not keep the w measurement"):
        measured.keep("w", ["m"], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        measured.keep("w", ["m"], 1)  # said once a process, whatever the kind
        measured.keep("v", ["m"], 1)
    assert measured.recall("w", ["m"]) is None


def test_the_probe_is_read_by_a_later_process_on_the_same_model_and_drafter(lm, kept, monkeypatch):
    monkeypatch.delenv("GMLX_ROUND_COSTS", raising=False)
    real, calls = probe.measure, []
    monkeypatch.setattr(probe, "measure", lambda *a: calls.append(a[2]) or real(*a))
    drafter = select_drafter(lm)
    assert lm.target.source is not None
    monkeypatch.setattr(probe, "_measured", type(probe._measured)())
    first = probe.round_costs(lm.target, drafter, 2)
    assert calls == [2] and first.source.startswith("measured") and "kept" not in first.source
    monkeypatch.setattr(probe, "_measured", type(probe._measured)())  # a new process
    again = probe.round_costs(lm.target, drafter, 2)
    assert calls == [2] and (again.verify, again.draft, again.rows) == (first.verify, first.draft, first.rows)
    assert again.source.startswith(first.source + "; kept from ")
    probe.round_costs(lm.target, drafter, 1)  # another K: measured
    probe.round_costs(lm.target, select_drafter(lm, "mtp"), 2)  # another drafter: measured
    assert calls == [2, 1, 2]


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory):
    import shutil

    from mlx_lm import convert

    from gmlx.models.loading import default_model_path

    out = tmp_path_factory.mktemp("q4k") / "model"
    convert(str(default_model_path()), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64)
    shutil.copy(default_model_path() / "mtp_config.json", out / "mtp_config.json")
    shutil.copy(default_model_path() / "mtp_head.safetensors", out / "mtp_head.safetensors")
    return out


def test_load_reads_the_decode_path_and_the_check_that_passed(q4_dir, kept, monkeypatch):
    monkeypatch.delenv("GMLX_DEQUANTIZED_DECODE", raising=False)
    first = load(q4_dir)
    names = sorted(p.name.split("-")[0] for p in kept.iterdir())
    assert names == ["check", "decode_path", "twin"] and first.target.twin is not None

    def untouchable(*a, **kw):
        raise AssertionError("measured again")

    monkeypatch.setattr(adapter.Target, "check", untouchable)
    monkeypatch.setattr(dequantized, "fastest", untouchable)
    monkeypatch.setattr(dequantized, "_write", untouchable)  # the twin read, not computed (and written)
    again = load(q4_dir)  # a later process: all three read
    assert again.target.decode_on_twin == first.target.decode_on_twin
    _same_twin(again.target)
    os.utime(q4_dir / "model.safetensors")  # the weights rewritten: another model
    with pytest.raises(AssertionError, match="measured again"):
        load(q4_dir)


def _same_twin(target) -> None:
    """Every dequantized weight of the twin equals the quantized layer's dequantization, bit for bit."""
    import mlx.core as mx
    import mlx.nn as nn

    twins = dict(target.twin.named_modules())
    n = 0
    for name, m in target.model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            assert mx.array_equal(twins[name].weight, w).item(), name  # sync: test check
            n += 1
    assert n > 0


def test_a_twin_cut_short_is_computed_again(q4_dir, kept, monkeypatch):
    monkeypatch.setenv("GMLX_DEQUANTIZED_DECODE", "0")
    load(q4_dir)
    (twin,) = kept.glob("twin-*")
    twin.write_bytes(twin.read_bytes()[:1000])
    _same_twin(load(q4_dir).target)  # computed, and written whole again
    assert twin.stat().st_size > 10 ** 6
    import mlx.core as mx

    mx.save_safetensors(str(twin), {k: v * 0 for k, v in mx.load(str(twin)).items()})  # whole, but not this model's
    _same_twin(load(q4_dir).target)  # the spot check of its rows refuses it: computed again
    monkeypatch.setenv("GMLX_KEEP_MEASURED", "0")
    _same_twin(load(q4_dir).target)


def test_one_twin_a_model_whatever_gmlx_code_or_switches(q4_dir, kept, monkeypatch):
    """The twin's values depend on the model's files and MLX's kernels alone: a change to gmlx's code
    measures the rest again but reads the one twin kept (a developer's edits write no new copies)."""
    monkeypatch.setenv("GMLX_DEQUANTIZED_DECODE", "0")
    load(q4_dir)
    monkeypatch.setattr(measured, "_machine_and_software", lambda real=measured._machine_and_software: {**real(),
                                                                                                      "code": "edited"})
    checks = []
    monkeypatch.setattr(adapter.Target, "check", lambda self: checks.append(self))
    monkeypatch.setattr(dequantized, "_write", lambda *a: pytest.fail("the twin written again"))
    load(q4_dir)
    assert len(checks) == 1 and len(list(kept.glob("twin-*"))) == 1


def test_a_check_that_fails_is_not_kept(q4_dir, kept, monkeypatch):
    monkeypatch.setenv("GMLX_DEQUANTIZED_DECODE", "0")

    def fails(self):
        raise ModelLoadError("the twin disagrees")

    monkeypatch.setattr(adapter.Target, "check", fails)
    with pytest.raises(ModelLoadError):
        load(q4_dir)
    assert not list(kept.glob("check-*"))
    monkeypatch.setenv("GMLX_KEEP_MEASURED", "0")  # off: checked in every process
    with pytest.raises(ModelLoadError):
        load(q4_dir)


def test_doctor_says_what_is_kept(kept, monkeypatch):
    assert measured.summary().startswith("0 files, 0 MB under ")
    measured.keep("x", ["m"], 1)
    assert measured.summary().startswith(f"1 file, 0 MB under {kept}")
    monkeypatch.setenv("GMLX_KEEP_MEASURED", "0")
    assert measured.summary().startswith("nothing (GMLX_KEEP_MEASURED=0)")
