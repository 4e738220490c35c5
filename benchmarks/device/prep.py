"""On the device: convert SmolLM2 (q and float32) from the carried GGUF. If the device's
transformers cannot rebuild the tokenizer, use the tokenizer files converted on the CPU machine."""
import shutil
import time
import traceback
from pathlib import Path

import gmlx  # noqa: F401
from gmlx.gguf import convert, smollm2

t = time.time()
try:
    print("q", smollm2.converted("q"))
except Exception:
    traceback.print_exc(limit=3)

    def write_tokenizer(meta, out, context_length):
        for f in Path("/tmp/gpu-whl/tok").glob("*.json"):
            shutil.copy(f, Path(out) / f.name)
    convert.write_tokenizer = write_tokenizer
    print("tokenizer: using the files converted on the CPU machine")
    print("q", smollm2.converted("q"))
print("f32", smollm2.converted("float32"), f"{time.time() - t:.1f} s")
from gmlx.models.loading import load
lm = load(smollm2.converted("float32"))
from gmlx.drafters.select import shipped_eagle3
print("eagle3 head:", shipped_eagle3(lm)[0])
