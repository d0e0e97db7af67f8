"""Regenerate the bundled chains ``bench/chains/*.json`` from the model zoo with ``meta_chain``.

    python bench/chains/make_chains.py            # all of them (about two minutes on one core)
    python bench/chains/make_chains.py --only resnet101   # names containing a substring
    python bench/chains/make_chains.py --list     # what would be written

Sizes are exact (meta device); times come from the V100 cost model of
``scheduler.profile.cost`` (rounded to 6 significant digits to keep the files small). Every file
is ``Chain.to_dict`` as compact JSON, loadable with ``scheduler.Chain.from_json(path)``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, Iterator, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if __name__ == "__main__":  # run as a script: bench/checkout.py says where the packages are
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import checkout
    checkout.on_path()

CNNS = ("resnet18", "resnet50", "resnet101", "resnet152", "resnet1001", "densenet121", "densenet201")
#: image size -> batch sizes. 1000/1-8 and ResNet-1001 224/1-8: seed 002 Figures 3-4;
#: 224/32: seed 000 Figure 4; 500/16: seed 001's setting.
CNN_BATCHES: Dict[int, Tuple[int, ...]] = {224: (1, 2, 4, 8, 32), 500: (1, 4, 16), 1000: (1, 2, 4, 8)}
#: model -> (batch sizes, sequence lengths). BERT batches 12/32: seed 004 Table 1 (QA, TC).
TRANSFORMERS: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]] = {
    "gpt2": ((1, 8), (256, 512, 1024, 2048)),
    "bert": ((12, 32), (64, 128, 256, 512)),
}


def configs() -> Iterator[Tuple[str, str, Dict[str, int]]]:
    """(file stem, zoo model, builder kwargs) of every bundled chain."""
    for model in CNNS:
        for image, batches in CNN_BATCHES.items():
            for b in batches:
                yield f"{model}-i{image}-b{b}", model, {"batch": b, "image": image}
    for model, (batches, seqs) in TRANSFORMERS.items():
        for b in batches:
            for t in seqs:
                yield f"{model}-s{t}-b{b}", model, {"batch": b, "seq_len": t}


def make(stem: str, model: str, kwargs: Dict[str, int]):
    from bench.models import build
    from scheduler.profile import meta_chain

    zoo = build(model, device="meta", **kwargs)
    chain = meta_chain(zoo.blocks, zoo.input_shape, input_dtype=zoo.input_dtype, name=stem)
    meta = {"model": model, **kwargs, "source": "bench/chains/make_chains.py (meta_chain)",
            **{k: chain.meta[k] for k in ("loss", "flops_per_s", "bytes_per_s", "torch")}}
    rounded = {f: [float(f"{v:.6g}") for v in getattr(chain, f)] for f in ("fw", "bw")}
    return chain.replace(**rounded, meta=meta)


def write(chain, path: str) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(chain.to_dict(), separators=(",", ":")) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", metavar="TEXT",
                   help="only chains whose name contains TEXT (e.g. resnet101, gpt2-s1024)")
    p.add_argument("--out", default=HERE, metavar="DIR", help="output folder (default: bench/chains)")
    p.add_argument("--list", action="store_true", help="list the chains and exit")
    a = p.parse_args(argv)
    todo = [c for c in configs() if a.only in c[0]]
    if not todo:   # a typo must not pass for "nothing to do"
        stems = [c[0] for c in configs()]
        models = ", ".join(dict.fromkeys(s.split("-")[0] for s in stems))
        p.error(f"--only {a.only!r}: no chain name contains it; the models are {models} "
                f"(names like {stems[0]}, {stems[-1]}; --list shows all {len(stems)})")
    if a.list:
        print("\n".join(c[0] for c in todo))
        return 0
    os.makedirs(a.out, exist_ok=True)
    for stem, model, kwargs in todo:
        t = time.perf_counter()
        chain = make(stem, model, kwargs)
        path = os.path.join(a.out, stem + ".json")
        write(chain, path)
        print(f"{stem:28s} L={chain.L:4d}  fw+bw={chain.total_compute():9.4f}s  "
              f"sum(xbar)={sum(chain.xbar) / 2**30:8.2f} GiB  ({time.perf_counter() - t:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
