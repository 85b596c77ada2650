"""How close a compiled directory's deployed blobs come to the source model, beside OpenVINO
CPU's own stateful run of the source at the same arithmetic.

    python scripts/accuracy.py OUT [--lengths 100,255,512,1000] [--prompts 6] [--new 4] [--backend openvino]

For each prompt length, `--prompts` random prompts (seeds 0, 1, ...; ids below the
vocabulary's first 300 or its size) run greedily for `--new` tokens three ways: the source
(recorded in OUT's manifest) on OpenVINO CPU at f32, the reference; OUT's pipeline on
`--backend`; and the source on OpenVINO CPU at the blobs' arithmetic and cache type
(`kvc.verify.peer_drift.Peer`, which `kvc verify` bounds the blobs by). Prints, per length,
the median logit NRMSE of each against the reference (`kvc.runtime.compare`) and the largest
ratio kvc / stateful over the prompts. The static models compute what the source computes;
this measures how well they keep it at a reduced precision, which the verification bounds
only at 3x the plugin's own drift (docs/verification.md). The relative-alibi pass was
measured with it (passes/relative_alibi.py).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--lengths", default="100,255,512,1000")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new", type=int, default=4)
    parser.add_argument("--backend", default="openvino")
    args = parser.parse_args()

    from kvc.export.load import backend_config, open_compiled
    from kvc.export.manifest import plan_of, read_manifest, recorded_source, vocab_of
    from kvc.runtime.compare import compare_generations
    from kvc.runtime.generate import greedy
    from kvc.verify.compiled import reference_session
    from kvc.verify.peer_drift import Peer

    manifest = read_manifest(args.directory)
    source = recorded_source(manifest, args.directory)
    config = backend_config(manifest, args.backend) or {}
    peer = Peer(source, config, [k.element_type for k in plan_of(manifest).kv])
    reference = reference_session(source, "openvino")
    pipe = open_compiled(args.directory, args.backend)
    high = min(300, vocab_of(manifest))
    print(f"{args.directory} on {args.backend} against {source} at f32; stateful: OpenVINO CPU at {peer.precision}, "
          f"cache {peer.config.get('KV_CACHE_PRECISION', 'f32')}")
    print("| prompt tokens | kvc NRMSE (median) | stateful NRMSE (median) | kvc / stateful (largest) |")
    print("|---:|---:|---:|---:|")
    for length in (int(n) for n in args.lengths.split(",")):
        kvc_errors, peer_errors = [], []
        for seed in range(args.prompts):
            prompt = np.random.default_rng(seed).integers(1, high, length).tolist()
            exact = greedy(reference, prompt, args.new)
            kvc_errors.append(compare_generations(exact, pipe.generate(prompt, args.new)).nrmse)
            peer_errors.append(compare_generations(exact, peer.run(prompt, args.new)).nrmse)
        ratio = max(k / p for k, p in zip(kvc_errors, peer_errors) if p > 0) if any(peer_errors) else float("nan")
        print(f"| {length} | {statistics.median(kvc_errors):.4f} | {statistics.median(peer_errors):.4f} | "
              f"{ratio:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
