#!/usr/bin/env python
"""Generate docs/coverage.md: every primitive JAX defines vs. polymask's rules.

Usage::

    python tools/coverage.py            # (re)write docs/coverage.md
    python tools/coverage.py --stdout   # print the table instead
    python tools/coverage.py --check    # exit 1 if docs/coverage.md is stale

The list of primitives comes from ``polymask._jax_compat.all_primitives()``
(module-level ``core.Primitive`` instances of ``jax._src.lax.*``,
``jax._src.random.*``, calls, custom derivatives, callbacks, ...); the covered
ones are ``polymask.rules.registered_primitives()``. Uncovered primitives get
the reason from ``REASONS`` (exact name) or ``GROUP_REASONS`` (name prefix),
default "no rule yet".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "coverage.md"
DEFAULT_REASON = "no rule yet"

# Why a primitive has no masking rule (exact names).
REASONS: dict[str, str] = {
    "dimension_size": "jax.export internal (only in exported modules, not in traced jaxprs)",
    "shape_assertion": "jax.export internal (only in exported modules, not in traced jaxprs)",
    "create_token": "tokens carry no array data; used only by ordered effects",
    "after_all": "tokens carry no array data; used only by ordered effects",
    "rng_uniform": "stateful XLA RNG (deprecated); use jax.random",
    "rng_bit_generator": "fills the whole padded buffer with bits; the logical prefix would "
                         "differ from the unpadded draw (no rule yet)",
    "device_put": "no rule yet (placement only; would be elementwise)",
    "inspect_sharding": "sharding introspection; no rule yet",
    "custom_partitioning": "opaque user SPMD partitioning rule over the padded shape",
    "shard_map": "manual SPMD over a mesh: per-shard logical sizes not modelled",
    "unreachable": "internal to custom_derivatives symbolic zeros",
    "eval_jaxpr": "internal to loop lowering",
    "composite": "no rule yet (would recurse into the decomposition)",
    "approx_top_k": "TPU approximate top-k; no rule yet",
}

# Reasons shared by a family (name prefix).
GROUP_REASONS: dict[str, str] = {
    "all_gather": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "all_to_all": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "ragged_all_to_all": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "psum": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "pmax": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "pmin": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "ppermute": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "pbroadcast": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "preduced": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "psend": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "precv": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "reduce_scatter": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "unreduced_": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "axis_index": "collective over a named mesh axis (SPMD), not a per-device shape op",
    "pvary": "SPMD varying-axes annotation; no rule yet",
    "vary_": "SPMD varying-axes annotation; no rule yet",
    "reduced_vary": "SPMD varying-axes annotation; no rule yet",
    "random_": "no rule yet (a sampler primitive drawing over the padded shape would differ "
               "from the unpadded draw)",
    "threefry": "raw PRNG bits over the padded shape differ from the unpadded draw "
                "(jax.random's random_bits is covered)",
    "philox": "raw PRNG bits over the padded shape differ from the unpadded draw",
    "get": "mutable refs (jax._src.state) are not supported inside mask",
    "swap": "mutable refs (jax._src.state) are not supported inside mask",
    "addupdate": "mutable refs (jax._src.state) are not supported inside mask",
    "new_ref": "mutable refs (jax._src.state) are not supported inside mask",
    "empty_ref": "mutable refs (jax._src.state) are not supported inside mask",
    "free_ref": "mutable refs (jax._src.state) are not supported inside mask",
    "freeze": "mutable refs (jax._src.state) are not supported inside mask",
    "accum_grad_in_ref": "mutable refs (jax._src.state) are not supported inside mask",
}

# Covered, but only partly: a note for the table.
NOTES: dict[str, str] = {
    "eig": "batch axes only; dynamic matrix axes raise (spectrum order)",
    "schur": "batch axes only; dynamic matrix axes raise (spectrum order)",
    "hessenberg": "batch axes only",
    "tridiagonal": "batch axes only",
    "geqrf": "identity embedding (Householder QR works left to right)",
    "geqp3": "batch axes only (column pivoting)",
    "householder_product": "cleaned reflectors, zero padding taus",
    "ormqr": "cleaned reflectors, zero padding taus",
    "svd": "singular vectors on dynamic axes need a square logical matrix",
    "eigh": "sorted, full spectrum on dynamic axes",
    "qr": "no column pivoting on dynamic axes",
    "fft": "dynamic transformed axes via Bluestein (bound <= 23170)",
    "check": "checkify.check: fails only where its case of a case split runs; formatting "
             "arguments of dynamic size refused",
    "debug_callback": "the callback sees the logical arrays (sliced on the host); "
                      "partitioned=True on dynamic operands refused",
    "debug_print": "prints the logical arrays (sliced on the host); partitioned=True on "
                   "dynamic operands refused",
    "pure_callback": "operands sliced, dim-var results padded on the host; ragged vmap: one "
                     "call per row (legacy_vectorized runs as sequential)",
    "io_callback": "operands sliced, dim-var results padded on the host; refused in loops "
                   "over a dynamic length (padding steps would run the side effect)",
    "ragged_dot_general": "modes 1-3, any dynamic axis JAX allows (group count static in modes "
                          "1, 2); binds polymask_ragged_dot (vmaps with shared weights); "
                          "group_offset refused",
}


def reason_for(name: str) -> str:
    if name in REASONS:
        return REASONS[name]
    for prefix, why in GROUP_REASONS.items():
        if name.startswith(prefix):
            return why
    return DEFAULT_REASON


def _rule_family(name: str) -> str:
    from polymask.rules import get_rule

    rule = get_rule(name)
    mod = getattr(rule, "__module__", "") or ""
    return mod.rsplit(".", 1)[-1] if mod.startswith("polymask.rules") else mod


def table() -> list[dict]:
    """One row per primitive JAX defines, plus rules for names JAX doesn't define here."""
    from polymask import _jax_compat as compat
    from polymask.rules import registered_primitives

    prims = compat.all_primitives()
    covered = set(registered_primitives())
    rows = []
    for name, module in prims.items():
        ok = name in covered
        rows.append({
            "primitive": name,
            "module": module.replace("jax._src.", ""),
            "status": "covered" if ok else "not covered",
            "rules": _rule_family(name) if ok else "",
            "note": NOTES.get(name, "") if ok else reason_for(name),
        })
    from polymask.rules.inlined import LIBRARY_PRIMITIVES

    for name in sorted(covered - set(prims)):
        library = LIBRARY_PRIMITIVES.get(name)
        rows.append({
            "primitive": name,
            "module": library or "(polymask / other JAX versions)",
            "status": "covered",
            "rules": _rule_family(name),
            "note": NOTES.get(name, "another library's primitive" if library else
                              "not defined by this JAX: polymask's own primitive, "
                              "an alias or another JAX version's name"),
        })
    return rows


def generate() -> str:
    import jax

    rows = table()
    jax_rows = [r for r in rows if not r["module"].startswith("(")]
    n_cov = sum(r["status"] == "covered" for r in jax_rows)
    lines = [
        "# Primitive coverage",
        "",
        "Generated by `python tools/coverage.py` (do not edit by hand) with "
        f"jax {jax.__version__}.",
        "",
        f"{n_cov} of {len(jax_rows)} primitives JAX defines have a masking rule. A primitive "
        "without a rule raises `polymask.UnsupportedError` naming it and the user's line; "
        "rules also raise `UnsupportedError` with the reason for the cases they cannot mask.",
        "",
        "| primitive | defined in | status | rules | notes / reason |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| `{r['primitive']}` | {r['module']} | {r['status']} | {r['rules']} | "
                     f"{r['note']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stdout", action="store_true", help="print instead of writing the doc")
    p.add_argument("--check", action="store_true", help="fail if the doc is out of date")
    p.add_argument("-o", "--output", default=str(DOC))
    args = p.parse_args(argv)
    text = generate()
    if args.stdout:
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if args.check:
        current = out.read_text() if out.exists() else ""
        if current != text:
            print(f"{out} is out of date: run python tools/coverage.py", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    raise SystemExit(main())
