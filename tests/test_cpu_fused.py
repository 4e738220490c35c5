"""The CPU backend's fused norms and rotary embeddings (gmlx/models/cpu_fused.py): the same values as
mlx-lm's modules, installed on what `load` returns, and off where they must be."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from gmlx.models import cpu_fused
from gmlx.models.cpu_fused import FusedRMSNorm, FusedRoPE, as_mlx_lm, install


def _same(a: mx.array, b: mx.array) -> bool:
    """Equal within float32's last bits: here the fused kernels give the very bits (max |diff| 0.0), but
    a compiler that contracts a multiply and an add into one instruction rounds once, not twice."""
    return np.allclose(np.array(a), np.array(b), rtol=2e-6, atol=2e-6)  # sync: test


@pytest.mark.parametrize("shape", [(1, 1, 64), (1, 5, 64), (3, 2, 64), (2, 9, 1, 64)])
def test_a_fused_norm_gives_mlx_lm_s_values_at_every_shape(shape):
    ref = nn.RMSNorm(64, eps=1e-6)
    ref.weight = mx.random.normal((64,), key=mx.random.key(1))
    fused = nn.RMSNorm(64, eps=1e-6)
    fused.weight = ref.weight
    assert install(fused) == 1 and type(fused) is FusedRMSNorm
    x = mx.random.normal(shape, key=mx.random.key(2)) * 3
    assert _same(fused(x), ref(x))


def test_norms_of_other_sizes_or_eps_do_not_share_a_trace():
    """The norm's trace is shapeless: its hidden size (the mean's divisor) and eps key it."""
    a, b, c = nn.RMSNorm(64, eps=1e-5), nn.RMSNorm(32, eps=1e-5), nn.RMSNorm(32, eps=1e-2)
    refs = [nn.RMSNorm(64, eps=1e-5), nn.RMSNorm(32, eps=1e-5), nn.RMSNorm(32, eps=1e-2)]
    for m in (a, b, c):
        install(m)
    for m, r in zip((a, b, c), refs):
        x = mx.random.normal((2, 3, r.weight.shape[0]), key=mx.random.key(3)) + 0.5
        assert _same(m(x), r(x))


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("length,offset", [(1, 0), (1, 37), (2, 37), (7, 5), (1, 38)])
def test_a_fused_rope_gives_mlx_lm_s_values_at_any_offset(traditional, length, offset):
    ref = nn.RoPE(64, traditional=traditional, base=100000.0)
    fused = nn.RoPE(64, traditional=traditional, base=100000.0)
    install(fused)
    x = mx.random.normal((1, 9, length, 64), key=mx.random.key(4))
    assert _same(fused(x, offset=offset), ref(x, offset=offset))
    assert _same(fused(x, offset=mx.array(offset)), ref(x, offset=offset))


def test_a_fused_rope_takes_a_batch_s_per_row_offsets():
    ref, fused = nn.RoPE(32), nn.RoPE(32)
    install(fused)
    x = mx.random.normal((4, 3, 2, 32), key=mx.random.key(5))
    offsets = mx.array([3, 0, 17, 9])
    assert _same(fused(x, offset=offsets), ref(x, offset=offsets))


@pytest.mark.parametrize("dims,base,scale", [(64, 100000.0, 1.0), (32, 10000.0, 0.25), (128, 500000.0, 1.0)])
@pytest.mark.parametrize("length,offset", [(1, 0), (1, 4095), (2, 37), (4, 120), (7, 5)])
def test_a_rope_at_a_host_position_shares_its_angles_and_gives_mlx_lm_s_values(dims, base, scale, length, offset):
    """An int offset (a KVCache's) takes the shared angles and one compiled rotation: mx.fast.rope's
    values (here its very bits: the same products summed in the same order; a compiler that
    contracts a multiply and an add may round once, hence `_same`)."""
    ref = nn.RoPE(dims, base=base, scale=scale)
    fused = nn.RoPE(dims, base=base, scale=scale)
    install(fused)
    x = mx.random.normal((1, 9, length, dims), key=mx.random.key(6)) * 2
    with cpu_fused.one_forward():
        out = fused(x, offset=offset)
        assert list(cpu_fused._local.angles) == [(dims, base, scale, offset, length)]  # the angles path
        fused(x[:, :3], offset=offset)  # another layer's call at the same position: the same angles
        assert len(cpu_fused._local.angles) == 1
    assert _same(out, ref(x, offset=offset))
    assert getattr(cpu_fused._local, "angles", None) is None  # nothing outlives the forward
    assert _same(fused(x, offset=offset), ref(x, offset=offset))  # (outside a forward's scope)


def test_a_batch_s_per_row_offsets_share_their_angles_across_layers():
    """Every layer's RaggedKVCache gives the same offsets array (gmlx/kv.py): the angles are
    computed once for it, and the rotation gives mx.fast.rope's values at per-row positions."""
    from gmlx.kv import RaggedKVCache

    layers = [RaggedKVCache.lift([_kv(n) for n in (5, 120, 0)]) for _ in range(2)]
    assert layers[0].offset is layers[1].offset
    ref, fused = nn.RoPE(64, base=100000.0), nn.RoPE(64, base=100000.0)
    install(fused)
    x = mx.random.normal((3, 9, 2, 64), key=mx.random.key(8))
    with cpu_fused.one_forward():
        outs = [fused(x, offset=c.offset) for c in layers]
        assert len(cpu_fused._local.angles) == 1
    for out, c in zip(outs, layers):
        assert _same(out, ref(x, offset=c.offset))


def _kv(n: int):
    from mlx_lm.models.cache import KVCache

    c = KVCache()
    if n:
        c.update_and_fetch(mx.zeros((1, 3, n, 64)), mx.zeros((1, 3, n, 64)))
    return c


def test_the_other_cases_take_the_compiled_fallback(monkeypatch):
    fused = nn.RoPE(16)
    install(fused)
    x = mx.random.normal((1, 2, 1, 16), key=mx.random.key(7))
    partial, trad = nn.RoPE(8), nn.RoPE(16, traditional=True)  # fewer dims than the head's; traditional
    install(partial), install(trad)
    with cpu_fused.one_forward():
        assert _same(partial(x, offset=3), nn.RoPE(8)(x, offset=3))
        assert _same(trad(x, offset=3), nn.RoPE(16, traditional=True)(x, offset=3))
        assert _same(fused(x.astype(mx.float16), offset=3), nn.RoPE(16)(x.astype(mx.float16), offset=3))
        assert _same(fused(x, offset=mx.array(3)), nn.RoPE(16)(x, offset=3))  # a scalar array offset
        monkeypatch.setattr(cpu_fused, "ANGLES", False)
        assert _same(fused(x, offset=3), nn.RoPE(16)(x, offset=3))
        assert not cpu_fused._local.angles  # none of these took the angles path


def test_a_forward_at_a_host_position_computes_its_angles_once(loaded_lm, tmp_path, monkeypatch):
    """Every layer's rotary embedding at one KVCache position reads the same kept angles: the
    forward's graph holds one cos and one sin (SmolLM2: 2,629 -> 2,172 operations)."""
    import re

    monkeypatch.setenv("GMLX_EARLY_DISPATCH", "0")  # the whole graph unevaluated, to be read

    target = loaded_lm.target
    cache = target.make_cache()
    mx.eval(target.model(mx.array([[1, 2, 3, 4]]), cache=cache), [c.state for c in cache])  # sync: test (the prompt)
    dot = tmp_path / "g.dot"
    mx.export_to_dot(str(dot), target.logits(mx.array([[5]]), cache))  # (the target's forwards are scoped)
    labels = re.findall(r'label ="([^"]+)"', dot.read_text())
    assert labels.count("Cos") == 1 and labels.count("Sin") == 1


def test_subclasses_keep_mlx_lm_s_code():
    """A Llama-3 or YaRN rotary embedding subclasses nn.RoPE with other arithmetic: not touched."""

    class Scaled(nn.RoPE):
        pass

    m = nn.Sequential(Scaled(32), nn.RMSNorm(8), nn.Linear(8, 8))
    assert install(m) == 1
    assert type(m.layers[0]) is Scaled and type(m.layers[1]) is FusedRMSNorm


def test_as_mlx_lm_runs_the_modules_unfused(monkeypatch):
    norm = nn.RMSNorm(16)
    install(norm)
    calls = []
    monkeypatch.setattr(cpu_fused, "_norm_fn", lambda *a: calls.append(a) or (lambda x, w: mx.fast.rms_norm(x, w, 1e-5)))
    x = mx.ones((1, 16))
    with as_mlx_lm():
        norm(x)
    assert calls == []
    norm(x)
    assert calls == [(norm.eps, 16)]


def test_nothing_is_fused_off_the_cpu_backend_or_with_compilation_off(monkeypatch):
    monkeypatch.setenv("GMLX_COMPILE", "0")
    m = nn.RMSNorm(8)
    assert install(m) == 0 and type(m) is nn.RMSNorm
    monkeypatch.delenv("GMLX_COMPILE")
    monkeypatch.setattr(cpu_fused.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert install(m) == 0 and type(m) is nn.RMSNorm


def test_load_fuses_the_target_s_and_the_head_s_modules(loaded_lm):
    """What a user's `load` returns runs fused (the oracle suites run that model: their streams
    are the fused forward's), and its logits are mlx-lm's unfused forward's."""
    kinds = {type(m) for _, m in loaded_lm.target.model.named_modules()}
    assert FusedRMSNorm in kinds and FusedRoPE in kinds and nn.RMSNorm not in kinds
    if loaded_lm.head is not None:  # (GMLX_TEST_MODEL may name a model without one)
        assert FusedRMSNorm in {type(m) for _, m in loaded_lm.head.module.named_modules()}
    x = mx.array([[1, 2, 3, 40, 50, 600, 7]])
    fused = loaded_lm.target.model(x)
    with as_mlx_lm():
        plain = loaded_lm.target.model(x)
    assert _same(fused, plain)


def test_threads_tracing_new_shapes_at_once_get_mlx_lm_s_values():
    """Two engines' threads may meet a new shape together: each call is whole (cpu_fused._lock)."""
    import threading

    ropes = [nn.RoPE(16, base=500.0) for _ in range(4)]
    for r in ropes:
        install(r)
    ref = nn.RoPE(16, base=500.0)
    errors = []

    def work(i):
        for n in range(1, 12):
            x = mx.random.normal((1, 2 + i, n, 16), key=mx.random.key(n))
            with cpu_fused.one_forward():  # each thread's forward shares its own angles
                out = ropes[i](x, offset=n)
            if not _same(out, ref(x, offset=n)):
                errors.append((i, n))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []

