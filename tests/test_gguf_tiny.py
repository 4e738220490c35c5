"""GGUF import on tiny files written here: an F16 llama converted with each dtype (q rows
un-permuted), and one-line errors for what gmlx does not convert."""

from __future__ import annotations

import json
import struct
import sys
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from gmlx.gguf.convert import GGUFError, convert_gguf, read_origin
from gmlx.gguf.llama_layout import dequantized, hf_name, quantization
from gmlx.gguf.reader import load_tensors, read_header
from gmlx.models.loading import load
from test_cli import run as cli_run
from test_gguf import _byte_chars, llama_cpp_permute, numpy_dequantize

LAYER_SHAPES = {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
                "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96), "attn_norm": (64,), "ffn_norm": (64,)}
HEADS, KV_HEADS = 4, 2


def tiny_llama(path, arch="llama", seed=0, extra=()) -> dict[str, mx.array]:
    """A 2-layer llama GGUF (F16 matrices, F32 norms, a 262-token byte vocabulary), written with
    mx.save_gguf; returns its weights as mlx-lm names and lays them out (q/k rows un-permuted)."""
    mx.random.seed(seed)
    shapes = {"token_embd.weight": (262, 64), "output_norm.weight": (64,)}
    shapes |= {f"blk.{i}.{n}.weight": s for i in range(2) for n, s in LAYER_SHAPES.items()}
    shapes |= {name: (64,) for name in extra}
    hf, gguf = {}, {}
    for name, shape in shapes.items():
        w = (mx.random.normal(shape) * 0.1).astype(mx.float16) if len(shape) == 2 else mx.ones(shape)
        if name not in extra:
            hf[hf_name(name)] = w
        heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(name.split(".")[2] if name.startswith("blk.") else "")
        gguf[name] = mx.array(llama_cpp_permute(np.array(w), heads)) if heads else w
    spell = _byte_chars()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt", "he", "Ġthe"] + [spell[b] for b in range(256)]
    u32 = partial(mx.array, dtype=mx.uint32)
    meta = {"general.architecture": arch, "general.name": "tiny", f"{arch}.block_count": u32(2),
            f"{arch}.embedding_length": u32(64), f"{arch}.feed_forward_length": u32(96),
            f"{arch}.attention.head_count": u32(HEADS), f"{arch}.attention.head_count_kv": u32(KV_HEADS),
            f"{arch}.context_length": u32(256), "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": mx.array([3, 3, 3] + [1] * (len(tokens) - 3), dtype=mx.int32),
            "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"], "tokenizer.ggml.eos_token_id": u32(2),
            "tokenizer.ggml.bos_token_id": u32(1)}
    mx.save_gguf(str(path), gguf, meta)
    return hf


@pytest.mark.parametrize("dtype", ["q", "float16", "float32"])
def test_tiny_f16_llama_converts_and_loads(tmp_path, dtype):
    hf = tiny_llama(tmp_path / "tiny.gguf")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out", dtype)
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization" not in cfg and cfg["eos_token_id"] == [2] and cfg["tie_word_embeddings"]
    lm = load(out)
    params = dict(tree_flatten(lm.target.model.parameters()))
    assert set(params) == set(hf)  # every tensor placed, none left out
    for name, w in hf.items():  # q/k rows back in the Hugging Face order, values untouched
        want = {"q": w.dtype, "float16": mx.float16, "float32": mx.float32}[dtype]
        assert params[name].dtype == want, name
        np.testing.assert_array_equal(np.array(params[name].astype(mx.float32)), np.array(w.astype(mx.float32)), name)
    assert lm.tokenizer.encode(" the") == [5] and lm.tokenizer.decode(lm.tokenizer.encode("tête 1")) == "tête 1"
    assert read_origin(out)["tensor_types"] == {"F16": 15, "F32": 5}
    assert mx.isfinite(lm.target.model(mx.array([[5, 6, 7]]))).all().item()


BLOCKS = {"Q4_0": (2, [("d", "<f2"), ("qs", "u1", 16)]), "Q4_1": (3, [("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)]),
          "Q8_0": (8, [("d", "<f2"), ("qs", "i1", 32)])}


def write_raw_gguf(path, tensors: dict[str, tuple[int, tuple[int, int], bytes]], arch="llama"):
    """A GGUF of tensors of any ggml type, name -> (type id, (rows, cols), data); mx.save_gguf
    writes only float and integer tensors."""
    def s(text):
        return struct.pack("<Q", len(text.encode())) + text.encode()
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), 1) + s("general.architecture") + struct.pack("<I", 8) + s(arch)
    data = b""
    for name, (type_id, (rows, cols), raw) in tensors.items():
        out += s(name) + struct.pack("<IQQIQ", 2, cols, rows, type_id, len(data))
        data += raw + b"\0" * (-len(raw) % 32)
    path.write_bytes(out + b"\0" * (-len(out) % 32) + data)


def random_blocks(kind: str, rows: int, cols: int, rng) -> bytes:
    """Random GGML blocks of `kind` with finite fp16 scales (and mins)."""
    type_id, fields = BLOCKS[kind]
    b = np.zeros(rows * cols // 32, dtype=np.dtype(fields))
    b["d"] = rng.uniform(0.001, 0.05, b.shape).astype(np.float16)
    if "m" in b.dtype.names:
        b["m"] = rng.uniform(-0.2, 0.2, b.shape).astype(np.float16)
    b["qs"] = rng.integers(-128 if kind == "Q8_0" else 0, 128 if kind == "Q8_0" else 256, b["qs"].shape)
    return b.tobytes()


def test_mlx_reads_each_supported_quantization_as_the_blocks_say(tmp_path):
    """What the converter relies on: MLX loads Q4_0, Q4_1 and Q8_0 blocks as affine groups of 32
    whose dequantized values (and bits, read from the shapes) are GGML's."""
    rng = np.random.default_rng(0)
    tensors = {f"blk.0.{n}.weight": (BLOCKS[kind][0], (48, 96), random_blocks(kind, 48, 96, rng))
               for n, kind in (("attn_q", "Q4_0"), ("attn_k", "Q4_1"), ("attn_v", "Q8_0"))}
    write_raw_gguf(tmp_path / "quants.gguf", tensors)
    header = read_header(tmp_path / "quants.gguf")
    raw, _ = load_tensors(tmp_path / "quants.gguf")
    weights = {hf_name(k): v for k, v in raw.items()}
    deq = dequantized(weights, mx.float32)
    assert quantization(weights) == {"group_size": 32, "bits": 4, "mode": "affine",
                                     "model.layers.0.self_attn.v_proj": {"group_size": 32, "bits": 8}}
    for info in header.tensors:
        ref = numpy_dequantize(tmp_path / "quants.gguf", info, header.data_offset)
        np.testing.assert_allclose(np.array(deq[hf_name(info.name)]), ref, rtol=1e-6, atol=1e-6, err_msg=info.type)


def assert_one_line_error(r, *needles):
    assert r.code == 1 and r.stdout == "" and "Traceback" not in r.stderr, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gmlx: error: "), r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_unsupported_files_are_one_line_errors(tmp_path):
    run = partial(cli_run, env={"GMLX_CACHE": str(tmp_path / "cache")})

    tiny_llama(tmp_path / "gpt2.gguf", arch="gpt2")
    write_raw_gguf(tmp_path / "q4k.gguf", {"blk.0.attn_q.weight": (12, (1, 256), b"\1" * 144)})  # MLX: float16
    write_raw_gguf(tmp_path / "q5.gguf", {"blk.0.attn_q.weight": (6, (1, 256), b"\1" * 22 * 8)})  # MLX fails
    (tmp_path / "text.gguf").write_text("not a model")
    tiny_llama(tmp_path / "bias.gguf", extra=["blk.1.attn_q.bias"])
    assert_one_line_error(run("convert", str(tmp_path / "bias.gguf"), str(tmp_path / "o")), "blk.1.attn_q.bias")
    assert_one_line_error(run("convert", str(tmp_path / "gpt2.gguf"), str(tmp_path / "o")), "architecture 'gpt2'")
    assert_one_line_error(run("convert", str(tmp_path / "q4k.gguf"), str(tmp_path / "o")), "Q4_K", "Q4_1")
    assert_one_line_error(run("convert", str(tmp_path / "q5.gguf"), str(tmp_path / "o")), "Q5_0")
    assert_one_line_error(run("convert", str(tmp_path / "text.gguf"), str(tmp_path / "o")), "not a GGUF file")
    assert_one_line_error(run("generate", "hi", "--model", str(tmp_path / "q4k.gguf")), "Q4_K")
    assert_one_line_error(run("convert", str(tmp_path / "missing.gguf"), str(tmp_path / "o")), "does not exist")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    tiny_llama(tmp_path / "tiny.gguf")
    assert_one_line_error(run("convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "busy")), "not an empty directory")
    assert_one_line_error(run("convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "o"), "--dtype", "bf16"), "bf16")
    assert not (tmp_path / "o").exists()
    r = run("convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "o"), "--dtype", "float32")
    assert r.code == 0 and "GGUF tiny.gguf (F16 x15, F32 x5; dequantized to float32" in r.stdout, r
    with pytest.raises(GGUFError, match="Q4_K"):
        convert_gguf(tmp_path / "q4k.gguf", tmp_path / "o2")


def test_a_transformers_without_the_gguf_tokenizer_converter_is_a_one_line_error(tmp_path, monkeypatch):
    """transformers 5.17 and before (mlx-lm allows >= 5.7; a device machine had 5.17) keep an older
    converter that builds another tokenizer: the conversion stops with the upgrade command and
    leaves no directory behind, rather than a traceback or a silently different tokenizer."""
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.gguf_tokenizer_mapping", None)  # import fails
    tiny_llama(tmp_path / "tiny.gguf")
    r = cli_run("convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "o"), env={"GMLX_CACHE": str(tmp_path / "c")})
    assert_one_line_error(r, "cannot build a GGUF file's tokenizer", "transformers>=5.18,<6")
    assert not (tmp_path / "o").exists()
