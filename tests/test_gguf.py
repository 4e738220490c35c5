"""GGUF import on the real model (SmolLM2-135M-Instruct, Q4_1 with a Q8_0 embedding): the tokenizer
against an independent byte-level BPE, weights against a numpy decoding of the file's bytes, the
un-permute against llama.cpp's layout run with interleaved rotary, the engine's streams against
mlx-lm's. Tiny synthetic files and the errors: test_gguf_tiny.py."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import numpy as np
import pytest
import regex
from mlx_lm.generate import generate_step
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from engine_helpers import drive, solo
from gmlx import Engine, EngineConfig, SamplingParams
from gmlx.gguf.convert import read_origin
from gmlx.gguf.reader import load_tensors, read_header
from gmlx.models.loading import load
from gmlx.engine.oracle import compare_streams, run_scalar

CHATML = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def meta(smollm2):
    return load_tensors(smollm2.gguf)[1]


# ---- tokenizer ------------------------------------------------------------------------------

CODE = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }", "const x = await fetch(`/api/${id}`);",
        'fn main() { println!("{}", 42); }', "SELECT * FROM users WHERE id = 7;", "x = {'a': [1, 2.5, None]}",
        "if __name__ == '__main__':\n\tmain()", "$ ls -la | grep .py && echo ok", "<div class=\"a\">&nbsp;</div>",
        '{"key": "value", "n": -1e-9}', "#include <stdio.h>", "lambda x: x**2 // 3 % 4", "a->b; c::d; e?.f ?? g"]
PROSE = ["The capital of France is Paris.", "It's what they've said: we'll see, I'm sure you'd agree.",
         "SHE'S HERE. They'RE not.", "A quick brown fox jumps over the lazy dog!", "Hello, world... (really?)",
         "Mr. Smith paid $3.50 for 2 apples -- a bargain.", "Well—that's “quoted” and ‘this’ too…"]
UNICODE = ["héllo wörld", "naïve café façade", "Ελληνικά γράμματα", "Русский текст", "مرحبا بالعالم",
           "שלום עולם", "हिन्दी भाषा", "ภาษาไทย", "한국어 문장", "日本語のテキスト", "中文文本处理", "繁體中文字",
           "Zürich straße", "ĳ ǅ ﬁ", "e\u0301 (combining)", "\u200bzero width\u200d"]
EMOJI = ["🙂", "👍🏽 ok", "👨‍👩‍👧‍👦 family", "🇫🇷🇯🇵", "❤️ love", "🚀🚀🚀", "a😀b", "🤖: beep"]
DIGITS = ["3.14159", "2024-11-30", "1,000,000", "0x1F", "½ ¾", "① ② ③", "٣٤٥", "Ⅻ", "12345678901234567890",
          "v1.2.3", "+44 (0)20 7946 0958", "1e10", "007"]
SPACE = ["  ", "\t\t", "\n\n\n", "a  b", " leading", "trailing ", "\r\n", "x\u00a0y", "\u3000全角", "a\u2003b",
         "\n \n", "    indented", "tab\tsep", " ", "end\n"]


def corpus() -> list[str]:
    base = CODE + PROSE + UNICODE + EMOJI + DIGITS + SPACE
    rng = random.Random(0)
    mixed = [rng.choice(["", " ", "\n", "\t", "  "]).join(rng.sample(base, rng.randint(2, 4))) for _ in range(240)]
    return base + mixed


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable spelling of each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


GPT2_SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def reference_encode(text: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[int]:
    """llama.cpp's "smollm" pre-tokenizer (each digit alone, then GPT-2's split) and byte-level BPE,
    written from the definitions, independently of transformers and tokenizers."""
    spell, ids = _byte_chars(), []
    for piece in regex.split(r"(\p{N})", text):
        for word in GPT2_SPLIT.findall(piece):
            parts = [spell[b] for b in word.encode("utf-8")]
            while len(parts) > 1:
                rank, i = min((ranks.get(p, 1 << 30), i) for i, p in enumerate(zip(parts, parts[1:])))
                if rank == 1 << 30:
                    break
                parts[i : i + 2] = [parts[i] + parts[i + 1]]
            ids += [vocab[p] for p in parts]
    return ids


def test_tokenizer_matches_reference_bpe_and_round_trips(smollm2, meta):
    tok = smollm2.load("float32").tokenizer
    vocab = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(meta["tokenizer.ggml.merges"])}
    texts = corpus()
    assert len(texts) >= 300
    for text in texts:
        ids = tok.encode(text)
        assert ids == reference_encode(text, vocab, ranks), repr(text)
        assert tok.decode(ids) == text, repr(text)
    assert tok.encode("2024") == [vocab[d] for d in "2024"]  # digits one by one, as the model was trained


def test_special_tokens_and_chat_template(smollm2):
    lm = smollm2.load("q")
    tok = lm.tokenizer
    assert lm.eos_ids == {2} and tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and len(ids) == 5  # special tokens stay whole
    assert tok.decode([1, 2, 0]) == "<|im_start|><|im_end|><|endoftext|>"
    assert tok.encode("hi")[0] != 1  # the file says add_bos_token = false
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == CHATML
    convo = messages + [{"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]
    text = tok.apply_chat_template(convo, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\nParis.<|im_end|>\n<|im_start|>user\nAnd Spain?<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=True) == tok.encode(CHATML)


# ---- weights and logits ---------------------------------------------------------------------

def numpy_dequantize(path, info, data_offset) -> np.ndarray:
    """A tensor decoded from the file's bytes by GGML's block layout (Q4_0, Q4_1, Q8_0)."""
    cols, rows = info.shape
    n = rows * cols // 32
    if info.type == "Q4_1":  # fp16 scale d, fp16 min m, 16 bytes: low nibbles are elements 0-15, high 16-31
        block = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", 16)])
    elif info.type == "Q4_0":  # fp16 scale d, 16 bytes of nibbles as Q4_1, each value (q - 8) * d
        block = np.dtype([("d", "<f2"), ("qs", "u1", 16)])
    elif info.type == "Q8_0":  # fp16 scale d, 32 int8
        block = np.dtype([("d", "<f2"), ("qs", "i1", 32)])
    else:
        raise AssertionError(info.type)
    b = np.fromfile(path, dtype=block, count=n, offset=data_offset + info.offset)
    d = b["d"].astype(np.float32)[:, None]
    if info.type == "Q8_0":
        x = b["qs"].astype(np.float32) * d
    else:
        q = np.concatenate([b["qs"] & 0x0F, b["qs"] >> 4], axis=1).astype(np.float32)
        x = q * d + b["m"].astype(np.float32)[:, None] if info.type == "Q4_1" else (q - 8) * d
    return x.reshape(rows, cols)


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute): HF rows -> GGUF rows."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_weights_equal_the_files_blocks(smollm2):
    header = read_header(smollm2.gguf)
    infos = {t.name: t for t in header.tensors}
    lm = smollm2.load("float32")
    model = lm.target.model.model
    layer0, layer7 = model.layers[0], model.layers[7]
    cases = [("token_embd.weight", model.embed_tokens.weight, None),
             ("blk.0.attn_q.weight", layer0.self_attn.q_proj.weight, 9),
             ("blk.7.attn_k.weight", layer7.self_attn.k_proj.weight, 3),
             ("blk.7.attn_v.weight", layer7.self_attn.v_proj.weight, None),
             ("blk.0.ffn_down.weight", layer0.mlp.down_proj.weight, None)]
    for name, converted, heads in cases:
        ref = numpy_dequantize(smollm2.gguf, infos[name], header.data_offset)
        got = np.array(converted)
        if heads:
            got = llama_cpp_permute(got, heads)
        assert got.dtype == np.float32 and got.shape == ref.shape, name
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6, err_msg=name)
    assert {infos["token_embd.weight"].type, infos["blk.0.attn_q.weight"].type} == {"Q8_0", "Q4_1"}


def test_unpermute_equals_interleaved_rotary_on_the_files_layout(smollm2):
    """llama.cpp's q/k row order is interleaved (traditional) rotary: the converted weights put
    back in the file's order (llama.cpp's own permutation) and run in mlx-lm's llama with
    rope_traditional=True must give the converted model's logits."""
    lm = smollm2.load("float32")
    cfg = json.loads((lm.path / "config.json").read_text())
    ref = llama.Model(llama.ModelArgs.from_dict(cfg | {"rope_traditional": True}))
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    weights = tree_flatten(lm.target.model.parameters())
    ref.load_weights([(k, mx.array(llama_cpp_permute(np.array(w), heads[k.split(".")[-2]]))
                       if k.split(".")[-2] in heads else w) for k, w in weights])
    x = mx.array([lm.tokenizer.encode("The capital of France is Paris. def f(n):\n    return n")])
    got, want = lm.target.model(x), ref(x)
    assert mx.abs(want).max().item() > 10  # real logits, not a degenerate model
    assert mx.abs(got - want).max().item() < 0.5  # float reordering; a wrong permutation is off by ~25


def test_quantized_logits_match_dequantized(smollm2):
    """The q conversion (MLX quantized kernels, the 8-bit embedding declared per layer) against the
    float32 one, which holds the same dequantized values: only arithmetic differs."""
    lq, lf = smollm2.load("q"), smollm2.load("float32")
    cfg = json.loads((lq.path / "config.json").read_text())
    assert cfg["quantization"]["bits"] == 4 and cfg["quantization"]["model.embed_tokens"]["bits"] == 8
    x = mx.array([lq.tokenizer.encode("<|im_start|>user\nThe capital of France is Paris.")])
    a, b = lq.target.model(x).astype(mx.float32), lf.target.model(x)
    la, lb = a - mx.logsumexp(a, -1, keepdims=True), b - mx.logsumexp(b, -1, keepdims=True)
    kl = (mx.exp(lb) * (lb - la)).sum(-1)
    assert kl.max().item() < 1e-2
    assert (a.argmax(-1) == b.argmax(-1)).astype(mx.float32).mean().item() > 0.95


def test_greedy_answer_says_paris(smollm2):
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=0)
    for dtype, prompt in (("q", "The capital of France is"), ("float32", CHATML)):
        lm = smollm2.load(dtype)
        row = run_scalar(lm, lm.tokenizer.encode(prompt), params, speculative=False)
        assert "Paris" in row.text, (dtype, prompt, row.text)


# ---- the engine on the real model -----------------------------------------------------------

def mlx_lm_greedy(lm, prompt, n):
    out = []
    for tok, _ in generate_step(mx.array(prompt), lm.target.model, max_tokens=n):
        if tok in lm.eos_ids:
            break
        out.append(tok)
    return out


def test_engine_streams_equal_mlx_lm_and_solo(smollm2):
    """Plain engine batches (requests joining mid-run) on the real model: greedy streams equal
    mlx-lm's generate_step, seeded T = 0.8 streams their solo plain decode (tie-aware)."""
    lm = smollm2.load("float32")
    tok = lm.tokenizer
    prompts = [tok.encode(CHATML.replace("the capital of France", "a good name for a cat")),
               tok.encode("def fibonacci(n):\n")]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, seed=0)
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=s) for s in (5, 6)]
    arrivals = {0: [("g0", prompts[0], greedy), ("s1", prompts[1], seeded[1])],
                2: [("g1", prompts[1], greedy), ("s0", prompts[0], seeded[0])]}
    run = drive(Engine(lm, EngineConfig(speculative=False)), arrivals)
    assert max(e.width for _, e in run.rounds()) >= 3  # the late requests joined the batch
    for label, stream in run.streams.items():
        req, rec = run.reqs[label], stream.wait(1)
        assert rec.finish_reason in ("length", "stop") and rec.tokens
        ref = mlx_lm_greedy(lm, req.prompt, 12) if label[0] == "g" else solo(lm, req.prompt, req.params)
        c = compare_streams(lm, req.prompt, ref, rec.tokens, req.params)
        assert c.ok, (label, c, ref, rec.tokens)
    assert run.streams["s0"].result.tokens != run.streams["g0"].result.tokens  # sampling really sampled


# ---- loading, the cache, the CLI ------------------------------------------------------------

def test_load_gguf_path_converts_once_into_the_cache(smollm2, monkeypatch):
    q_dir = smollm2.path("q")  # converted by the fixture through the same cache
    monkeypatch.setenv("GMLX_CACHE", str(smollm2.cache_dir))
    monkeypatch.setattr("gmlx.gguf.convert.convert_gguf", lambda *a: pytest.fail("converted again"))
    lm = load(smollm2.gguf)
    assert lm.path == q_dir and lm.name == smollm2.gguf.name
    assert lm.drafter_kind == "mtp"  # the head gmlx trained for this file (gmlx/weights/smollm2/)
    origin = read_origin(q_dir)
    assert origin["source"] == smollm2.gguf.name and origin["dtype"] == "q" and len(origin["sha256"]) == 64
    assert origin["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    assert not [p for p in (smollm2.cache_dir / "gguf").iterdir() if p.name.startswith(".")]  # no temp left


def test_doctor_reports_the_gguf_origin(smollm2):
    from test_cli import run

    r = run("doctor", "--model", str(smollm2.path("q")))
    assert r.code == 0, r.stderr
    assert "GGUF SmolLM2-135M-Instruct.Q4_1.gguf (Q4_1 x210, F32 x61, Q8_0 x1; quantization kept" in r.stdout
