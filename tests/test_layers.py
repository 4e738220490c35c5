"""The package's shape: layers import downward only, no file name is used twice, and no file is
over MAX_LINES (one concept per file).

Every module's imports are read with `ast` (those inside functions and under TYPE_CHECKING too:
a lazy import is still a dependency). A module may import its own layer or a lower one; the
layers, lowest first (docs/design.md §4):

    foundations   errors, switches, finish, timing, atomic_file, measured, compiled, small_gemm, openblas_core, blas, machine, config, data (prompts), weights
    pieces        recurrent (and its journal), processors, sampling, kv, model_cache, prompt_cache,
                  request_stats, row, trace
    models        the target: adapter, family, checkpoint, dequantized, gated_delta, forward
    heads, gguf   drafter heads; the GGUF reader and converter
    loading       models/loading.py: a target with its head, from any source
    drafters      the drafter protocol and its kinds
    policy        admission, caps, costs, the online control (decides, never applies)
    decode        the lanes: prefill, scalar, batch, tree, the acceptance rule
    engine        the engine, its service and intake; the stream oracle; the public API (gmlx)
    serve, distributed   peers: neither imports the other

The runtime package never imports the training package (gmlx_training) nor test code.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gmlx"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "switches", "finish", "timing", "atomic_file", "measured", "compiled", "small_gemm", "openblas_core", "blas", "machine", "config", "data", "weights"),
    ("recurrent", "recurrent_journal", "processors", "sampling", "kv", "model_cache", "prompt_cache",
     "request_stats", "row", "trace"),
    ("models",),
    ("heads", "gguf"),
    ("models.loading",),
    ("drafters",),
    ("policy",),
    ("decode",),
    ("engine", ""),  # "": the package itself (gmlx/__init__.py: the public API, Engine among it)
    ("serve", "distributed"),
]
PEERS = {"serve": "distributed", "distributed": "serve"}
# What the runtime package never imports: the training package, the CLI, and test or benchmark
# code (tests/ and benchmarks/ modules are imported by their bare names, e.g. `from doubles import`).
OUTSIDE = {"gmlx_training", "gmlx_cli", "tests", "benchmarks"} | {
    f.stem for folder in ("tests", "benchmarks") for f in (ROOT / folder).glob("*.py")}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path) -> set[str]:
    """The modules `path` imports (a `from pkg import name` that names a module counts as it)."""
    mod = module_name(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
                base = base[: len(base) - node.level + 1] + ([node.module] if node.module else [])
                module = ".".join(base)
            else:
                module = node.module or ""
            for a in node.names:
                sub = f"{module}.{a.name}"
                out.add(sub if sub in MODULES else module)
    return out


def layer(module: str) -> tuple[int, str]:
    """(rank, the layer's entry) of a gmlx module: the longest entry that is a prefix of it."""
    rel = module.removeprefix("gmlx").removeprefix(".")
    best = None
    for rank, entries in enumerate(LAYERS):
        for e in entries:
            if rel == e or (e and rel.startswith(e + ".")) or (not e and not rel):
                if best is None or len(e) > len(best[1]):
                    best = (rank, e)
    assert best is not None, f"{module} is in no layer: add it to LAYERS (tests/test_layers.py)"
    return best


def violations(deps: dict[str, set[str]]) -> list[str]:
    """Each import in `deps` (module -> the modules it imports) that runs upward, or across the
    peers, or out of the runtime package."""
    bad = []
    for mod, imported in sorted(deps.items()):
        rank, entry = layer(mod)
        for dep in sorted(imported):
            if dep.split(".")[0] in OUTSIDE:
                bad.append(f"{mod} imports {dep} (outside the runtime package)")
                continue
            if dep != "gmlx" and not dep.startswith("gmlx."):
                continue
            dep_rank, dep_entry = layer(dep)
            if dep_rank > rank or PEERS.get(entry.split(".")[0]) == dep_entry.split(".")[0]:
                bad.append(f"{mod} ({entry or 'gmlx'}) imports {dep} ({dep_entry or 'gmlx'})")
    return bad


def test_every_module_is_in_a_layer():
    for mod in MODULES:
        layer(mod)


def test_layers_import_downward_only():
    assert violations({mod: imports(path) for mod, path in MODULES.items()}) == []


def test_the_check_sees_what_it_forbids():
    # The check is not vacuous: the imports issue 23 found (decode -> engine.row, drafters ->
    # decode.prefill), a peer import, and the product importing training or test code.
    assert set(violations({"gmlx.decode.batch": {"gmlx.engine.row", "gmlx.row", "gmlx.kv"},
                           "gmlx.drafters.draft_model": {"gmlx.decode.prefill", "gmlx.models.forward"},
                           "gmlx.serve.app": {"gmlx.distributed.cluster", "gmlx.engine.stream"},
                           "gmlx.models.loading": {"gmlx.heads.mtp_head", "gmlx.drafters.mtp"},
                           "gmlx.serve.loadgen": {"gmlx_training.train_default", "gmlx"},
                           "gmlx.engine.oracle": {"tests.doubles", "doubles"}})) == {
        "gmlx.engine.oracle imports doubles (outside the runtime package)",
        "gmlx.decode.batch (decode) imports gmlx.engine.row (engine)",
        "gmlx.drafters.draft_model (drafters) imports gmlx.decode.prefill (decode)",
        "gmlx.engine.oracle imports tests.doubles (outside the runtime package)",
        "gmlx.models.loading (models.loading) imports gmlx.drafters.mtp (drafters)",
        "gmlx.serve.app (serve) imports gmlx.distributed.cluster (distributed)",
        "gmlx.serve.loadgen imports gmlx_training.train_default (outside the runtime package)"}


def test_no_file_name_twice():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    assert [n for n, c in names.items() if c > 1] == []


MAX_LINES = 300  # the code standard: one concept per file, files under ~300 lines
SIZED = ("gmlx", "gmlx_cli", "gmlx_training")


def test_no_file_over_max_lines():
    long = {str(p.relative_to(ROOT)): n for folder in SIZED for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concept (one concept per file, under {MAX_LINES} lines): {long}"
