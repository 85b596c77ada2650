"""Build kvc's benchmark model: a random-weight ~250M-parameter Llama, exported four ways.

Run with the fixtures virtualenv (torch, transformers, optimum-intel, onnx):

    /work/venv-fx/bin/python bench/build_model.py                # build what is missing
    /work/venv-fx/bin/python bench/build_model.py --out DIR      # somewhere else
    /work/venv-fx/bin/python bench/build_model.py --force        # rebuild everything

Outputs (not committed; `bench/.models/` is git-ignored):

    <out>/hf/                          save_pretrained of the seeded model (the source of the rest)
    <out>/llama-250m-fp32/             optimum-cli stateful IR, --weight-format fp32
    <out>/llama-250m-fp16/             optimum-cli stateful IR, --weight-format fp16
    <out>/llama-250m-fp32-stateless/   optimum-cli --disable-stateful, fp32
    <out>/llama-250m.onnx (+ .data)    torch.onnx (dynamo=False) export, weights as external data

No tokenizer is built: the HF directory has no tokenizer files and optimum-cli runs with
--disable-convert-tokenizer, so there is no openvino_tokenizer.xml (the benchmarks feed token ids).
optimum still writes a placeholder tokenizer.json (transformers' default Llama tokenizer, 3 BPE
tokens); ignore it. Each step writes into a temporary sibling and
renames it when done, so an interrupted build never leaves an output that looks finished.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SEED = 0
ONNX_NAME = "llama-250m.onnx"
CONFIG = dict(
    hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
    intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048,
    initializer_range=0.02, tie_word_embeddings=False,
)
# name -> extra optimum-cli arguments
IR_EXPORTS = {
    "llama-250m-fp32": ["--weight-format", "fp32"],
    "llama-250m-fp16": ["--weight-format", "fp16"],
    "llama-250m-fp32-stateless": ["--weight-format", "fp32", "--disable-stateful"],
}


def step(name: str):
    """`with step(name):` prints the wall time of one build step."""

    class _Timer:
        def __enter__(self):
            print(f"[{name}] ...", flush=True)
            self.started = time.monotonic()

        def __exit__(self, *exc):
            status = "failed" if exc[0] else "done"
            print(f"[{name}] {status} in {time.monotonic() - self.started:.1f} s", flush=True)
            return False

    return _Timer()


def fresh(path: Path) -> Path:
    """A temporary sibling of `path`, emptied."""
    tmp = path.with_name(path.name + ".tmp")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    elif tmp.exists():
        tmp.unlink()
    return tmp


def build_hf(hf_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**CONFIG, dtype="float32")
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"  {params / 1e6:.1f} M parameters", flush=True)
    tmp = fresh(hf_dir)
    model.eval().save_pretrained(tmp)
    tmp.rename(hf_dir)


def export_ir(hf_dir: Path, out_dir: Path, extra: list[str]) -> None:
    tmp = fresh(out_dir)
    cmd = [sys.executable, "-m", "optimum.commands.optimum_cli", "export", "openvino",
           "--model", str(hf_dir), "--task", "text-generation-with-past",
           "--disable-convert-tokenizer", *extra, str(tmp)]
    print("  " + " ".join(cmd[1:]), flush=True)
    result = subprocess.run(cmd, env={**os.environ, "PYTHONHASHSEED": "0"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if result.returncode != 0 or not (tmp / "openvino_model.xml").exists():
        sys.exit(f"optimum-cli export to {out_dir.name} failed:\n{result.stdout}")
    tmp.rename(out_dir)


def load_fixture_exporter():
    """fixtures/build.py's export_onnx (wrapper with a ready 4-D causal mask), imported by path."""
    spec = importlib.util.spec_from_file_location("_kvc_fixtures_build", REPO / "fixtures" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module.export_onnx


def export_onnx(hf_dir: Path, onnx_path: Path) -> None:
    """torch.onnx export into a temp dir (weights inline, < 2 GB), then re-save with external data."""
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    export = load_fixture_exporter()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa",
                                                 dtype=torch.float32).eval()
    tmp = fresh(onnx_path.with_name(".onnx-export"))
    tmp.mkdir()
    try:
        started = time.monotonic()
        export(model, model.config, tmp / "model.onnx")
        print(f"  torch.onnx.export {time.monotonic() - started:.1f} s", flush=True)
        del model
        started = time.monotonic()
        proto = onnx.load(str(tmp / "model.onnx"))
        # Names in the final directory, written under temp names first then renamed together.
        data_name = onnx_path.name + ".data"
        tmp_onnx = tmp / onnx_path.name
        onnx.save_model(proto, str(tmp_onnx), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        del proto
        onnx.checker.check_model(str(tmp_onnx))  # by path: works with external data
        print(f"  external data re-save {time.monotonic() - started:.1f} s", flush=True)
        (tmp / data_name).replace(onnx_path.with_name(data_name))
        tmp_onnx.replace(onnx_path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=BENCH / ".models",
                        help="cache directory (default: bench/.models/)")
    parser.add_argument("--force", action="store_true", help="rebuild every output")
    args = parser.parse_args(argv)
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = out / "hf"
    onnx_path = out / ONNX_NAME
    if args.force:
        for path in [hf_dir, *(out / name for name in IR_EXPORTS)]:
            shutil.rmtree(path, ignore_errors=True)
        for path in (onnx_path, onnx_path.with_name(onnx_path.name + ".data")):
            path.unlink(missing_ok=True)

    started = time.monotonic()
    if (hf_dir / "config.json").exists():
        print(f"[hf model] exists: {hf_dir}")
    else:
        with step("hf model"):
            build_hf(hf_dir)
    for name, extra in IR_EXPORTS.items():
        if (out / name / "openvino_model.xml").exists():
            print(f"[{name}] exists: {out / name}")
            continue
        with step(name):
            export_ir(hf_dir, out / name, extra)
    if onnx_path.exists() and onnx_path.with_name(onnx_path.name + ".data").exists():
        print(f"[onnx] exists: {onnx_path}")
    else:
        with step("onnx"):
            export_onnx(hf_dir, onnx_path)
    print(f"total {time.monotonic() - started:.1f} s")
    for path in sorted(out.iterdir()):
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        print(f"  {sum(p.stat().st_size for p in files) / 1e6:9.1f} MB  {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
