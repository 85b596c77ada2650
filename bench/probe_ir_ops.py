"""How long the OpenVINO model operations a static-shape compiler needs take, on the bench model.

Run with /work/venv-dev/bin/python (openvino, numpy):

    probe_ir_ops.py ops   --model DIR [--work DIR]   read/clone/reshape/save timings, constant sharing
    probe_ir_ops.py dedup --model DIR [--work DIR]   does ov.save_model write shared constants once?
    probe_ir_ops.py variants --model DIR [--work DIR]  clone+reshape+save of prefill + 4 generate shapes

Each prints JSON lines (one per measurement) and cleans up what it wrote under --work
(default: a temp dir). DIR is an optimum-cli output directory or the .xml itself.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops

GENERATE_SHAPE = {"input_ids": [1, 1], "attention_mask": [1, 1152], "position_ids": [1, 1], "beam_idx": [1]}


def model_xml(path: str) -> Path:
    p = Path(path)
    return p / "openvino_model.xml" if p.is_dir() else p


def rss_mb() -> dict:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            fields[line.split(":")[0]] = round(int(line.split()[1]) / 1024, 1)
    return fields


def emit(**result) -> None:
    result["loadavg_1m"] = round(os.getloadavg()[0], 2)
    result["mem_mb"] = rss_mb()
    print(json.dumps(result), flush=True)


def timed(fn):
    started, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, round(time.perf_counter() - started, 3), round(time.process_time() - cpu, 3)


def biggest_constant(model: ov.Model):
    """The Constant with the most bytes (the embedding or LM head)."""
    consts = [op for op in model.get_ops() if op.get_type_name() == "Constant"]
    return max(consts, key=lambda c: c.get_byte_size())


def data_ptr(const) -> int:
    return np.asarray(const.get_data()).__array_interface__["data"][0]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def shapes(model: ov.Model) -> dict:
    return {
        "inputs": {p.get_any_name(): str(p.get_partial_shape()) for p in model.inputs},
        "outputs": {p.get_any_name(): str(p.get_partial_shape()) for p in model.outputs},
    }


# --------------------------------------------------------------------------- ops


def cmd_ops(args, work: Path) -> None:
    core = ov.Core()
    xml = model_xml(args.model)
    model, wall, cpu = timed(lambda: core.read_model(str(xml)))
    emit(op="read_model", model=str(xml), wall_s=wall, cpu_s=cpu,
         ops=len(model.get_ops()), sinks=len(model.get_sinks()))

    out = work / "saved"
    _, wall, cpu = timed(lambda: ov.save_model(model, str(out / "openvino_model.xml"), compress_to_fp16=False))
    emit(op="save_model(compress_to_fp16=False)", wall_s=wall, cpu_s=cpu,
         bin_bytes=(out / "openvino_model.bin").stat().st_size, source_bin_bytes=xml.with_suffix(".bin").stat().st_size)
    shutil.rmtree(out)
    # Second save: page cache warm, destination freshly created again.
    _, wall, cpu = timed(lambda: ov.save_model(model, str(out / "openvino_model.xml"), compress_to_fp16=False))
    emit(op="save_model(compress_to_fp16=False), 2nd", wall_s=wall, cpu_s=cpu)
    shutil.rmtree(out)

    clone, wall, cpu = timed(model.clone)
    emit(op="clone", wall_s=wall, cpu_s=cpu)
    big, big_clone = biggest_constant(model), biggest_constant(clone)
    emit(op="clone shares constants?", constant=big.get_friendly_name(),
         clone_constant=big_clone.get_friendly_name(),
         shape=str(big.get_output_shape(0)), type=big.get_output_element_type(0).get_type_name(),
         bytes=big.get_byte_size(), same_node=big is big_clone,
         same_data_ptr=data_ptr(big) == data_ptr(big_clone),
         ptr_original=hex(data_ptr(big)), ptr_clone=hex(data_ptr(big_clone)))

    _, wall, cpu = timed(lambda: clone.reshape(GENERATE_SHAPE))
    emit(op="reshape(generate [1,1], mask [1,1152]) on the clone", wall_s=wall, cpu_s=cpu,
         result=shapes(clone), original_after=shapes(model)["inputs"])
    _, wall, cpu = timed(lambda: ov.save_model(clone, str(out / "openvino_model.xml"), compress_to_fp16=False))
    emit(op="save_model of the reshaped clone", wall_s=wall, cpu_s=cpu,
         bin_bytes=(out / "openvino_model.bin").stat().st_size)
    shutil.rmtree(out)


# --------------------------------------------------------------------------- dedup


def cmd_dedup(args, work: Path) -> None:
    """Save models that use the same weight two ways and look at the .bin size.

    1. synthetic: two MatMuls on the *same* Constant node, on two Constant nodes sharing
       memory (made with ov.Tensor(shared_memory=True) over one numpy array), and on two
       Constants with equal data in separate buffers.
    2. real: a model with two Gathers, one on the LLM's biggest constant and one on the clone's.
    3. real: original and clone saved as two models (two files: no cross-file dedup possible).
    """
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((1024, 1024)).astype(np.float32)  # 4 MiB
    one = weight.nbytes

    def save_two(name: str, c1, c2) -> None:
        x = ops.parameter([1, 1024], np.float32, name="x")
        model = ov.Model([ops.matmul(x, c1, False, True), ops.matmul(x, c2, False, True)], [x], name)
        path = work / name / "m.xml"
        ov.save_model(model, str(path), compress_to_fp16=False)
        size = path.with_suffix(".bin").stat().st_size
        emit(op=f"dedup: {name}", bin_bytes=size, one_weight_bytes=one, copies_written=round(size / one, 2))

    same = ops.constant(weight)
    save_two("same Constant node twice", same, same)
    save_two("two Constant nodes over shared memory",
             ops.constant(ov.Tensor(weight, shared_memory=True)), ops.constant(ov.Tensor(weight, shared_memory=True)))
    save_two("two Constants, equal data, separate buffers", ops.constant(weight.copy()), ops.constant(weight.copy()))

    core = ov.Core()
    xml = model_xml(args.model)
    model = core.read_model(str(xml))
    clone = model.clone()
    big, big_clone = biggest_constant(model), biggest_constant(clone)
    ids = ops.parameter([1, 4], np.int64, name="ids")
    axis = ops.constant(np.int64(0))
    pair = ov.Model([ops.gather(big.output(0), ids, axis), ops.gather(big_clone.output(0), ids, axis)], [ids], "pair")
    path = work / "pair" / "m.xml"
    ov.save_model(pair, str(path), compress_to_fp16=False)
    size = path.with_suffix(".bin").stat().st_size
    emit(op="dedup: LLM's biggest constant, original + clone, in one model", constant=str(big.get_output_shape(0)),
         type=big.get_output_element_type(0).get_type_name(),
         bin_bytes=size, one_weight_bytes=big.get_byte_size(), copies_written=round(size / big.get_byte_size(), 2))

    for name, m in (("original", model), ("clone", clone)):
        ov.save_model(m, str(work / name / "openvino_model.xml"), compress_to_fp16=False)
    emit(op="dedup: original and clone saved as two models",
         bin_bytes={name: (work / name / "openvino_model.bin").stat().st_size for name in ("original", "clone")})


# --------------------------------------------------------------------------- variants


def cmd_variants(args, work: Path) -> None:
    """What a compiler that writes prefill + 4 generate variants spends in clone/reshape/save."""
    core = ov.Core()
    xml = model_xml(args.model)
    model, wall, cpu = timed(lambda: core.read_model(str(xml)))
    emit(op="read_model", wall_s=wall, cpu_s=cpu)
    variants = {"prefill": {"input_ids": [1, 1024], "attention_mask": [1, 1024], "position_ids": [1, 1024],
                            "beam_idx": [1]}}
    for total in (1152, 2176, 4224, 8320):  # pyramid-like sizes 1024*2^k + 128
        variants[f"generate_{total}"] = {"input_ids": [1, 1], "attention_mask": [1, total],
                                         "position_ids": [1, 1], "beam_idx": [1]}
    started = time.perf_counter()
    total_bytes = 0
    for name, shape in variants.items():
        clone, t_clone, _ = timed(model.clone)
        _, t_reshape, _ = timed(lambda: clone.reshape(shape))
        out = work / name / "openvino_model.xml"
        _, t_save, _ = timed(lambda: ov.save_model(clone, str(out), compress_to_fp16=False))
        size = out.with_suffix(".bin").stat().st_size
        total_bytes += size
        emit(op=f"variant {name}", clone_s=t_clone, reshape_s=t_reshape, save_s=t_save, bin_bytes=size)
        del clone
    emit(op="variants total", n=len(variants), wall_s=round(time.perf_counter() - started, 3),
         bin_bytes=total_bytes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cmd", choices=["ops", "dedup", "variants"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvc-bench-", dir=args.work))
    try:
        {"ops": cmd_ops, "dedup": cmd_dedup, "variants": cmd_variants}[args.cmd](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"op": "process peak", "ru_maxrss_mb": round(peak, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
