"""Random-program differential tester for the packed layout.

Builds random ONE-EXAMPLE programs ``f(w, x0)`` over an example ``x0`` of
shape ``(n, 4)`` and a shared weight ``w`` of shape ``(4, 4)``, drawn from
every packed rule family (elementwise, reductions over ``n``, cumulative,
contractions and attention with several heads, shifts to ``n + c``, windows,
sorting, gathers, scans, loops, conds, segment reductions), and checks

- values: ``ragged_map(f, ("n, 4",), layout="packed", row_size=R)`` on a
  batch of sizes 0, 1, R - 1, R, many short examples (several share a row)
  and, in ``PADDED_FRACTION`` of the programs, R + 1 (it runs in the padded
  layout: two more compiles) against plain ``f`` on each example alone:
  integers exact, floats ``allclose`` (rtol = atol = 2e-5), the same NaN and
  inf positions;
- NaN/inf isolation: the same batch with NaN (then +inf) written into one
  entry of one example. Every OTHER example must equal its plain result
  ("crossed" when it does not); the corrupted example must equal its plain
  result too, NaN and inf kinds included. Two things IEEE or XLA leave
  open are not asked of it: NaN/inf is not written where the data is a
  convolution's kernel (``Op.nonfinite_min``: XLA multiplies the padding or
  not by shape), and after ``top_k`` its NaNs may rank in another order
  (``Op.nan_sign_order``: NaN sign bits);
- gradients: ``loss(w, x0) = sum(g(f(w, x0)))`` with a head ``g`` of
  restricted domain (``sqrt(diff(y) + 1)``, ``log(y + 2)``, a norm, ...):
  ``value_and_grad(loss, (None, "n, 4"), layout="packed", reduce="sum")``
  against the sum of ``jax.value_and_grad(loss)`` over the examples whose
  plain loss and gradient are finite (the others are left out of the batch):
  within rtol = atol = 1e-4, or as close to plain JAX in float64 as plain
  JAX's float32 result is (near a singular derivative float32 sums in
  another order differ by more than any fixed tolerance).

``PackedUnsupported`` is a refusal, not a failure (counted by primitive);
any other exception is an error. An example below the program's ``min_n``
(the smallest size plain JAX accepts, from the op table) is left out; where
plain JAX raises at a size the table lets through, polymask must raise
``polymask.ShapeError`` on that example.

Each failure prints a runnable program that reproduces it (shrunk: ops and
examples dropped while it still fails, the first time a failure's signature
is seen).

At d9f5ae6 (before the packed invariant, 1a4f152) it finds NaN/inf crossing
between examples through multi-head attention (``mh_shared_v``,
``mh_sum_heads``, ``dpa_gqa_causal``: "crossed") and NaN gradients from dead
entries of ``x[1:]``/``jnp.diff`` under ``sqrt`` (``proj | sqrt_diff``,
``proj | sqrt_tail_proj``: "grad").

Speed: compiles and traces are most of the time (a program: the plain
reference, values and gradients in ONE jitted program reused by the NaN/inf
batches; the packed ``ragged_map`` and ``value_and_grad`` programs, plus their
padded fallbacks). The CLI turns XLA's backend optimizations and MLIR fusion
emitters off (``polymask._jax_compat.versions.fast_compile_xla_flags``;
``--full-compile`` keeps the defaults):
about 0.8 programs/s on one core, 2.5x the first version. ``--jobs 2`` runs
programs in two spawned processes (each program has its own RNG stream: the
same results in the same order), for two free cores.

    python tools/packed_fuzz.py --seed 0 --programs 2000   # a long run by hand
    python tools/packed_fuzz.py --seed 0 --seconds 60 --jobs 2
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
import textwrap
import time
import traceback
import warnings

import numpy as np

D = 4  # the example's feature size; w is (D, D)

# ----------------------------------------------------------------------------
# The op menu. Each op reads `x` (the current value), `x0` (the example, (n, 4))
# and `w` ((4, 4)), and assigns `x` (its last line). Kinds of `x`:
#   seq    (m, 4) float, m = n + c along the ragged axis
#   vec    (4,) float, one per example          mat   (k, 4) float, k static
#   scalar () float                              ivec / iscalar: int, terminal
# min_n: the smallest m at which plain JAX accepts the op (checked by
# `python tools/packed_fuzz.py --check-min-n`). dn: seq -> seq size change.
# ----------------------------------------------------------------------------

ANY = ("seq", "vec", "mat", "scalar")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    family: str
    src: str
    kinds: tuple = ("seq",)
    out: str | None = None  # None: the kind it takes
    dn: int = 0
    min_n: int = 0
    reset: bool = False  # the result has x0's size n (c = 0)
    plain_min: int | None = None  # plain JAX's smallest size where min_n is kept higher
    # below this size the data is a convolution's kernel, where XLA itself gives
    # a NaN/inf different results by shape (it multiplies the padding or not:
    # jnp.convolve([1, -.5, .25], x) at n = 3 with an inf has NaN at both ends,
    # jnp.convolve(x, [1, -.5, .25], "full") at n = 2 has none): no NaN/inf goes there
    nonfinite_min: int = 0
    # orders NaNs by their sign bit (XLA's TopK), which IEEE leaves unspecified for
    # a NaN made by arithmetic: a sum of NaN terms takes one term's sign, in an
    # order of XLA's choosing
    nan_sign_order: bool = False


def _attn(q, k, v, causal=False):
    s = f"s = ({q}) @ ({k}).T * 0.5"
    if causal:
        s += "\n    s = jnp.where(jnp.tril(jnp.ones((s.shape[0], s.shape[0]), bool)), s, -1e9)"
    return s + f"\n    x = jax.nn.softmax(s, axis=-1) @ ({v})"


_HEADS = "h = x.reshape(x.shape[0], 2, 2)\n    p = jax.nn.softmax(jnp.einsum(\"nhd,mhd->hnm\", h @ w[:2, :2], h), axis=-1)"
# the kernel in the data's dtype: the float64 gradient check runs the program in float64
_DW = "jnp.tile(jnp.array([[[0.25, 0.5, -0.75]]], x.dtype), (4, 1, 1))"


def _conv(padding):
    return (f"x = jax.lax.conv_general_dilated(x.T[None], {_DW}, (1,), {padding}, "
            f"feature_group_count=4)[0].T")


def _convolve(mode):
    return (f"x = jnp.stack([jnp.convolve(x[:, j], jnp.array([1.0, -0.5, 0.25]), mode={mode!r}) "
            f"for j in range(4)], axis=1)")


def _dpa(nq, nkv, causal):
    q = "jnp.concatenate([x @ w, x], axis=1).reshape(-1, 4, 2)" if nq == 4 else \
        "(x @ w).reshape(-1, 2, 2)"
    k = {2: "x.reshape(-1, 2, 2)", 1: "(x @ w)[:, :2].reshape(-1, 1, 2)"}[nkv]
    v = {2: "(x @ w).reshape(-1, 2, 2)", 1: "x[:, 2:].reshape(-1, 1, 2)"}[nkv]
    back = ".reshape(-1, 4, 2).mean(-1)" if nq == 4 else ".reshape(-1, 4)"
    return (f"x = jax.nn.dot_product_attention({q}, {k}, {v}, is_causal={causal})"
            f"{back}")


OPS = [
    # elementwise (any kind)
    Op("sin", "elementwise", "x = jnp.sin(x)", ANY),
    Op("tanh", "elementwise", "x = jnp.tanh(x)", ANY),
    Op("affine", "elementwise", "x = x * 1.5 - 0.25", ANY),
    Op("leaky", "elementwise", "x = jnp.where(x > 0, x, 0.1 * x)", ANY),
    Op("sq_clip", "elementwise", "x = jnp.clip(x * x, 0.0, 4.0)", ANY),
    Op("add_row", "elementwise", "x = x + w[0]", ("seq", "vec", "mat")),
    # reductions over n
    Op("center", "reductions", "x = x - jnp.mean(x, axis=0)"),
    Op("softmax_n", "reductions", "x = jax.nn.softmax(x, axis=0)"),
    Op("scale_max", "reductions", "x = x / (1.0 + jnp.max(jnp.abs(x), axis=0))", min_n=1),
    Op("sum0", "reductions", "x = jnp.sum(x, axis=0)", out="vec"),
    Op("mean0", "reductions", "x = jnp.mean(x, axis=0)", out="vec"),
    Op("max0", "reductions", "x = jnp.max(x, axis=0)", out="vec", min_n=1),
    Op("min0", "reductions", "x = jnp.min(x, axis=0)", out="vec", min_n=1),
    Op("logsumexp0", "reductions", "x = jax.nn.logsumexp(x, axis=0)", out="vec"),
    Op("argmax0", "reductions", "x = jnp.argmax(x, axis=0)", out="ivec", min_n=1),
    Op("total", "reductions", "x = jnp.sum(x * x)", out="scalar"),
    Op("len_scale", "reductions", "x = x * (1.0 / (1.0 + x.shape[0]))"),
    # cumulative
    Op("cumsum", "cumulative", "x = jnp.cumsum(x, axis=0)"),
    Op("cummax", "cumulative", "x = jax.lax.cummax(x, axis=0)"),
    Op("assoc_add", "cumulative", "x = jax.lax.associative_scan(jnp.add, x, axis=0)"),
    Op("assoc_max_rev", "cumulative",
       "x = jax.lax.associative_scan(jnp.maximum, x, axis=0, reverse=True)"),
    Op("reverse", "cumulative", "x = x[::-1]"),
    Op("rev_cumsum", "cumulative", "x = jnp.cumsum(x[::-1], axis=0)[::-1]"),
    # contractions
    Op("proj", "contractions", "x = x @ w"),
    Op("gram", "contractions", "x = x.T @ x", out="mat"),
    Op("gram_apply", "contractions", "x = x @ (x.T @ x) * 0.1"),
    Op("attn", "contractions", _attn("x @ w", "x", "x")),
    Op("attn_causal", "contractions", _attn("x", "x @ w", "x", causal=True)),
    Op("mh_shared_v", "contractions",
       _HEADS + "\n    x = jnp.einsum(\"hnm,md->hnd\", p, x).mean(0)"),
    Op("mh_sum_heads", "contractions",
       _HEADS + "\n    x = jnp.tile(jnp.einsum(\"hnm,mhd->nd\", p, h), (1, 2))"),
    Op("mh_per_head_v", "contractions",
       _HEADS + "\n    x = jnp.einsum(\"hnm,mhd->nhd\", p, h).reshape(-1, 4)"),
    Op("mh_transposed", "contractions",  # contracting the block-diagonal operand's FIRST packed axis
       _HEADS + "\n    x = jnp.einsum(\"hmn,md->hnd\", p.transpose(0, 2, 1), x).sum(0)"),
    Op("attn_dense_lhs", "contractions",
       "x = (x.T @ jax.nn.softmax((x @ w) @ x.T, axis=-1).T).T"),
    Op("attn_positions", "contractions",  # finite weights from positions, values x
       "pos = jnp.arange(x.shape[0]) * 1.0\n"
       "    x = jax.nn.softmax(-jnp.abs(pos[:, None] - pos[None, :]), axis=-1) @ x"),
    Op("dpa_2h", "contractions", _dpa(2, 2, False)),
    Op("dpa_2h_causal", "contractions", _dpa(2, 2, True)),
    Op("dpa_gqa", "contractions", _dpa(4, 2, False)),
    Op("dpa_gqa_causal", "contractions", _dpa(4, 2, True)),
    Op("dpa_mqa_causal", "contractions", _dpa(4, 1, True)),
    # shifts to n + c
    Op("drop_first", "shifts", "x = x[1:]", dn=-1),
    Op("drop_last", "shifts", "x = x[:-1]", dn=-1),
    Op("diff", "shifts", "x = jnp.diff(x, axis=0)", dn=-1),
    Op("pad12", "shifts", "x = jnp.pad(x, ((1, 2), (0, 0)))", dn=3),
    Op("cls_row", "shifts", "x = jnp.concatenate([w[:1], x])", dn=1),
    Op("roll", "shifts", "x = jnp.roll(x, 1, axis=0)"),
    Op("inner", "shifts", "x = x[1:-1]", dn=-2),
    # windows
    Op("conv_same", "windows", _conv('"SAME"')),
    Op("conv_valid", "windows", _conv('"VALID"'), dn=-2),
    Op("conv_causal", "windows", _conv("((2, 0),)")),
    Op("conv_full", "windows", _conv("((2, 2),)"), dn=2),
    Op("convolve_same", "windows", _convolve("same"), min_n=1, nonfinite_min=3),
    Op("convolve_full", "windows", _convolve("full"), dn=2, min_n=1, nonfinite_min=3),
    # jnp.convolve "valid" swaps its operands below n = 3 (size 3 - n + 1, not n - 2)
    Op("convolve_valid", "windows", _convolve("valid"), dn=-2, min_n=3, plain_min=1),
    Op("pool_sum_same", "windows",
       "x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (3, 1), (1, 1), \"SAME\")"),
    Op("pool_sum_valid", "windows",
       "x = jax.lax.reduce_window(x, 0.0, jax.lax.add, (3, 1), (1, 1), \"VALID\")", dn=-2),
    Op("pool_max_same", "windows",
       "x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 1), (1, 1), \"SAME\")"),
    Op("pool_max_valid", "windows",
       "x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 1), (1, 1), \"VALID\")", dn=-1),
    # sorting
    Op("sort0", "sorting", "x = jnp.sort(x, axis=0)"),
    Op("argsort_rows", "sorting", "x = x[jnp.argsort(x[:, 0])]"),
    Op("top_k", "sorting", "x = jnp.tile(jax.lax.top_k(x[:, 0], 2)[0], 2)", out="vec", min_n=2,
       nan_sign_order=True),
    Op("top_k_idx", "sorting", "x = jax.lax.top_k(x[:, 1], 2)[1]", out="ivec", min_n=2,
       nan_sign_order=True),
    # gathers
    Op("first", "gathers", "x = x[0]", out="vec", min_n=1),
    Op("last", "gathers", "x = x[-1]", out="vec", min_n=1),
    Op("argmax_row", "gathers", "x = x[jnp.argmax(x[:, 0])]", out="vec", min_n=1),
    Op("take_clip", "gathers", "x = jnp.take(x, jnp.array([0, 2, 5]), axis=0, mode=\"clip\")",
       out="mat", min_n=1),
    Op("take_fill", "gathers",
       "x = jnp.take(x, jnp.array([1, 0, 7]), axis=0, mode=\"fill\", fill_value=-1.0)",
       out="mat", min_n=1),
    Op("dyn_slice", "gathers", "x = jax.lax.dynamic_slice_in_dim(x, 1, 2, axis=0)", out="mat",
       min_n=2),
    Op("shift_gather", "gathers",
       "x = jnp.take(x, jnp.minimum(jnp.arange(x.shape[0]) + 1, x.shape[0] - 1), axis=0)"),
    # scans along n
    Op("scan_ys", "scans",
       "x = jax.lax.scan(lambda c, v: (jnp.tanh(c @ w + v), c), jnp.zeros(4, x.dtype), x)[1]"),
    Op("scan_carry", "scans",
       "x = jax.lax.scan(lambda c, v: (c * 0.5 + v, None), jnp.zeros(4, x.dtype), x)[0]",
       out="vec"),
    Op("scan_rev", "scans",
       "x = jax.lax.scan(lambda c, v: (jnp.maximum(c, v), c + v), jnp.full(4, -1.0), x, "
       "reverse=True)[1]"),
    # loops
    Op("fori", "loops", "x = jax.lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v @ w) + 0.1 * v, x)"),
    Op("fori_cum", "loops",
       "x = jax.lax.fori_loop(0, 2, lambda i, v: jnp.cumsum(v, axis=0) * 0.5, x)"),
    Op("while_shared", "loops",
       "x = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, jnp.tanh(s[1] @ w)), "
       "(0, x))[1]"),
    Op("while_per_example", "loops",
       "x = jax.lax.while_loop(lambda s: (s[0] < 5) & (jnp.sum(jnp.abs(s[1])) < 20.0), "
       "lambda s: (s[0] + 1, s[1] * 1.5 + 0.1), (0, x))[1]"),
    # conds. Thresholds sit off the values earlier ops make exactly (0 after
    # centering or a zero-sum kernel, 1 after a softmax): a predicate at such a
    # value is decided by rounding, which differs between any two compilations
    # of it (plain JAX's own included), so no layout can match it (seeds 3532
    # #927, #1071, #2154 before this)
    Op("cond_sum", "conds",
       "x = jax.lax.cond(jnp.sum(x) > 0.1234, lambda v: v @ w, lambda v: jnp.cumsum(v, axis=0), "
       "x)"),
    Op("cond_first", "conds",
       "x = jax.lax.cond(x[0, 0] > 0, lambda v: jnp.tanh(v), lambda v: v[::-1] * 2.0, x)",
       min_n=1),
    Op("switch3", "conds",
       "s = jnp.sum(x[:, 1])\n    x = jax.lax.switch(jnp.where(s > 1.0317, 0, "
       "jnp.where(s < -1.0317, 1, 2)), "
       "[lambda v: v, lambda v: jnp.sort(v, axis=0), lambda v: v - jnp.mean(v, axis=0)], x)"),
    # segment reductions within an example
    Op("segment_sum", "segments",
       "x = jax.ops.segment_sum(x, jnp.arange(x.shape[0]) % 3, num_segments=3)", out="mat"),
    Op("segment_max", "segments",
       "x = jax.ops.segment_max(x, jnp.arange(x.shape[0]) // 2, num_segments=2)", out="mat"),
    # back to the ragged axis from a per-example value
    Op("scale_x0", "broadcast", "x = x0 * x", ("vec", "scalar"), out="seq", reset=True),
    Op("x0_times_mat", "broadcast", "x = x0 @ (x.T @ x) * 0.1", ("mat",), out="seq", reset=True),
]

# Restricted-domain heads of the loss: loss(w, x0) = jnp.sum(<head>(f(w, x0)))


@dataclasses.dataclass(frozen=True)
class Head:
    name: str
    src: str  # an expression in y (f's result) and w
    kinds: tuple = ANY


HEADS = [
    Head("sqrt_sq", "jnp.sqrt(y * y + 1e-3)"),
    Head("norm", "jnp.linalg.norm(y, axis=-1)", ("seq", "vec", "mat")),
    Head("softplus", "jnp.log1p(jnp.exp(y))"),
    Head("sqrt_diff_sq", "jnp.sqrt(jnp.diff(y, axis=0) ** 2 + 1)", ("seq", "vec", "mat")),
    Head("sqrt_diff_proj", "jnp.sqrt(jnp.diff(y @ w, axis=0) + 1)", ("seq", "vec", "mat")),
    Head("sqrt_diff", "jnp.sqrt(jnp.diff(y, axis=0) + 1)", ("seq", "vec", "mat")),
    Head("sqrt_plus", "jnp.sqrt(y + 1)"),
    # the domain holds on what plain JAX reads (y[1:]); y[0], like the packed
    # value's dead entries, may lie outside it
    Head("sqrt_tail", "jnp.sqrt(y[1:] + 1)", ("seq", "vec", "mat")),
    Head("sqrt_tail_proj", "jnp.sqrt(y[1:] @ w + 1)", ("seq", "vec", "mat")),
    Head("log_head", "jnp.log(y[:-1] + 1.5)", ("seq", "vec", "mat")),
    Head("log_plus", "jnp.log(y + 2)"),
    Head("square", "y * y"),
]

_PRELUDE = "import jax\nimport jax.numpy as jnp\nimport numpy as np\n"

# the comparison, run here and printed into every repro program
_SAME_SRC = '''\
def same(got, want):
    """Integers exact; floats allclose with the same NaN and inf entries (the
    example holding the NaN/inf included)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not np.issubdtype(want.dtype, np.floating):
        return bool(np.array_equal(got, want))
    fin = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), fin):
        return False
    if not (np.array_equal(np.isnan(got), np.isnan(want))
            and np.array_equal(got[np.isinf(got)], want[np.isinf(want)])):
        return False
    return bool(np.allclose(got[fin], want[fin], rtol=RTOL, atol=ATOL))
'''
RTOL = ATOL = 2e-5
_env: dict = {"np": np, "RTOL": RTOL, "ATOL": ATOL}
exec(_SAME_SRC, _env)
same = _env["same"]


@dataclasses.dataclass
class Program:
    ops: list
    head: Head | None
    row_size: int | None  # None: ragged_map's default
    sizes: list

    @property
    def kind(self) -> str:
        k = "seq"
        for o in self.ops:
            k = o.out or k
        return k

    @property
    def min_n(self) -> int:
        """The smallest example size every op accepts (sizes n + c with clamps
        at 0 are at least n + c: a floor)."""
        return self._smallest_n("min_n")

    @property
    def nonfinite_min_n(self) -> int:
        """The smallest example size a NaN/inf is written into (``Op.nonfinite_min``)."""
        return self._smallest_n("nonfinite_min")

    def _smallest_n(self, field: str) -> int:
        """The smallest example size ``n`` for which every op's input size
        ``n + c`` is at least the op's ``field``."""
        need, c, kind = 0, 0, "seq"
        for o in self.ops:
            if kind == "seq":
                need = max(need, getattr(o, field) - c)
                c += o.dn
            if o.reset:
                c = 0
            kind = o.out or kind
        return need

    def source(self) -> str:
        lines = ["def f(w, x0):", "    x = x0"]
        for o in self.ops:
            body = o.src.split("\n")
            body[-1] += f"  # {o.name}"
            lines += ["    " + b.strip() for b in body]
        return "\n".join(lines + ["    return x"])

    def loss_source(self) -> str:
        return f"def loss(w, x0):\n    y = f(w, x0)\n    return jnp.sum({self.head.src})  # {self.head.name}"

    def namespace(self) -> dict:
        env: dict = {}
        src = _PRELUDE + self.source() + ("\n\n" + self.loss_source() if self.head else "")
        if self.head:  # the loss and f's value, for the plain reference (_plain_ref)
            src += f"\n\n\ndef _loss_y(w, x0):\n    y = f(w, x0)\n    return jnp.sum({self.head.src}), y\n"
        exec(compile(src, "<packed fuzz program>", "exec"), env)
        return env

    def names(self) -> str:
        return " > ".join(o.name for o in self.ops) + (f" | {self.head.name}" if self.head else "")


PADDED_FRACTION = 0.3  # programs with a row size that also get an example of size R + 1


def random_program(rng) -> Program:
    kind, ops, growth = "seq", [], 0
    for _ in range(int(rng.integers(1, 4))):
        cands = [o for o in OPS if kind in o.kinds]
        if growth >= 4:  # keep sizes small: no more growing shifts
            cands = [o for o in cands if o.dn <= 0]
        # every family equally likely, then an op of it
        fams = sorted({o.family for o in cands})
        fam = fams[int(rng.integers(len(fams)))]
        cands = [o for o in cands if o.family == fam]
        op = cands[int(rng.integers(len(cands)))]
        ops.append(op)
        growth += max(op.dn, 0)
        kind = op.out or kind
        if kind in ("ivec", "iscalar"):
            break
    heads = [h for h in HEADS if kind in h.kinds]
    head = heads[int(rng.integers(len(heads)))] if heads else None
    row_size = [8, 16, None][int(rng.integers(3))]
    if row_size is None:  # the default rows (at least 64): 0, 1 and short examples
        sizes = [0, 1] + list(rng.integers(1, 9, size=int(rng.integers(6, 12))))
    else:
        short = rng.integers(1, max(2, row_size // 3) + 1, size=int(rng.integers(6, 12)))
        sizes = [0, 1, row_size, row_size - 1] + list(short)
        if rng.random() < PADDED_FRACTION:  # runs padded: two more compiles (values, gradient)
            sizes.append(row_size + 1)
    sizes = [int(s) for s in sizes]
    order = rng.permutation(len(sizes))
    return Program(ops, head, row_size, [sizes[i] for i in order])


# ----------------------------------------------------------------------------
# The checks
# ----------------------------------------------------------------------------


class Refused(Exception):
    def __init__(self, primitive: str, message: str):
        super().__init__(message)
        self.primitive = primitive


def _refusal(e) -> Refused:
    m = re.search(r"primitive '([^']+)'", str(e))
    if m:
        prim = m.group(1)
    elif "case per size" in str(e):
        prim = "<case per size>"
    else:
        prim = "<" + str(e).splitlines()[0][:60] + ">"
    return Refused(prim, str(e))


def _plain(f, w, x):
    import jax.numpy as jnp
    return np.asarray(f(jnp.asarray(w), jnp.asarray(x)))


def _plain_raises(f, w, n) -> bool:
    import jax
    try:
        jax.eval_shape(f, w, jax.ShapeDtypeStruct((n, D), np.float32))
        return False
    except Exception:
        return True


def _plain_ref(env, w, examples, grad=()):
    """Plain JAX on each exact example, as ONE jitted program per fuzz program
    (unrolled over the examples; the NaN/inf batches have the same shapes and
    reuse it): ``f``'s value on every example and, on the examples at the
    indices ``grad``, ``jax.value_and_grad(loss)`` (its forward pass gives
    ``f``'s value: no second copy). Returns (values, {index: (loss, grad)});
    the dict is None where plain JAX cannot differentiate (a while_loop)."""
    import jax
    progs = env.setdefault("_plain_progs", {})
    grad = tuple(grad) if grad and not env.get("_no_grad") else ()

    def build(grad):
        # inner jits: the examples of one size share one trace and one lowering
        f = jax.jit(env["f"])
        vg = jax.jit(jax.value_and_grad(env["_loss_y"], has_aux=True)) if grad else None

        def each(w, xs):
            out = []
            for j, x in enumerate(xs):
                if j in grad:
                    (v, y), g = vg(w, x)
                    out.append((y, v, g))
                else:
                    out.append((f(w, x),))
            return out
        return jax.jit(each)

    if grad not in progs:
        progs[grad] = build(grad)
    try:
        outs = progs[grad](w, examples)
    except Exception:
        if not grad:
            raise
        # plain JAX cannot differentiate it (a while_loop): values only
        env["_no_grad"] = True
        return _plain_ref(env, w, examples)[0], None
    values = [np.asarray(o[0]) for o in outs]
    pairs = {j: (np.asarray(o[1]), np.asarray(o[2])) for j, o in enumerate(outs) if len(o) > 1}
    return values, (pairs if grad else None)


def _plain_all(env, w, examples):
    """Plain ``f`` on each example alone."""
    return _plain_ref(env, w, examples)[0]


def _finite_grads(w, examples, pairs):
    """The examples whose plain loss and gradient are finite, and their sums."""
    keep, tot_v, tot_g = [], 0.0, np.zeros_like(w, dtype=np.float64)
    for j, (v, g) in sorted((pairs or {}).items()):
        if np.isfinite(v).all() and np.isfinite(g).all():
            keep.append(examples[j])
            tot_v += float(v)
            tot_g += g
    return keep, np.float32(tot_v), tot_g.astype(np.float32)


def _plain_grads(env, w, examples):
    """Plain value_and_grad on each example; the examples whose loss and gradient
    are finite, and their sums."""
    _, pairs = _plain_ref(env, w, examples, grad=range(len(examples)))
    return _finite_grads(w, examples, pairs)


def _packed_outputs(prog, env, w, examples):
    """``ragged_map`` (one per program: the NaN/inf batches reuse its compiled programs)."""
    import polymask as pm
    if "_rm" not in env:
        env["_rm"] = pm.ragged_map(env["f"], ("n, 4",), layout="packed", row_size=prog.row_size,
                                   compile_ahead=False)
    rm = env["_rm"]
    try:
        with warnings.catch_warnings():  # the batches hold an example of R + 1 by design
            warnings.simplefilter("ignore", pm.PackedLayoutWarning)
            return [np.asarray(o) for o in rm(examples, w)]
    except pm.PackedUnsupported as e:
        raise _refusal(e) from None


def _corrupt(examples, rng, value, min_n=0):
    """A copy of the batch with ``value`` written into one entry of an example
    that shares a row (the longest examples are alone: a short one) and has
    at least ``min_n`` rows (``Program.nonfinite_min_n``)."""
    cands = [i for i, x in enumerate(examples) if max(1, min_n) <= len(x) <= 8]
    if not cands:
        return None, examples
    i = cands[int(rng.integers(len(cands)))]
    ex = [x.copy() for x in examples]
    r, c = int(rng.integers(len(ex[i]))), int(rng.integers(D))
    ex[i][r, c] = value
    return i, ex


def _same_values(got, want) -> bool:
    """The same values in another order (NaNs last): where a NaN/inf example's
    NaNs are ranked by their sign bits (``Op.nan_sign_order``); indices of
    such a ranking (``top_k``'s) are positions of NaNs of either sign, so an
    integer result only needs its shape."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    if np.issubdtype(want.dtype, np.integer):
        return got.dtype == want.dtype
    return np.issubdtype(want.dtype, np.floating) and same(
        np.sort(got, axis=None), np.sort(want, axis=None))


def _check_values(prog, env, w, examples, want, corrupted=None):
    """Returns (kind, message) of the first mismatch, or None. kind: "value",
    or "crossed" for an example that is not the corrupted one in a NaN/inf run."""
    got = _packed_outputs(prog, env, w, examples)
    bad = []
    nan_order = any(o.nan_sign_order for o in prog.ops)
    for i, (g, v) in enumerate(zip(got, want)):
        if not same(g, v) and not (nan_order and i == corrupted and _same_values(g, v)):
            bad.append(i)
    if not bad:
        return None
    crossed = [i for i in bad if corrupted is not None and i != corrupted]
    kind = "crossed" if crossed else "value"
    i = (crossed or bad)[0]
    return kind, (f"{kind}: examples {bad} differ (n = {[len(examples[j]) for j in bad]}); "
                  f"example {i}: packed {got[i].tolist()} != plain {np.asarray(want[i]).tolist()}")


def _check_grads(prog, env, w, examples, want_v, want_g):
    import jax.numpy as jnp

    import polymask as pm
    vg = pm.value_and_grad(env["loss"], (None, "n, 4"), layout="packed", reduce="sum",
                           row_size=prog.row_size)
    try:
        got_v, got_g = vg(jnp.asarray(w), examples)
    except pm.PackedUnsupported as e:
        raise _refusal(e) from None
    got_v, got_g = np.asarray(got_v), np.asarray(got_g)
    tol = dict(rtol=1e-4, atol=1e-4)
    ok_v = np.isfinite(got_v) and np.allclose(got_v, want_v, **tol)
    ok_g = np.isfinite(got_g).all() and np.allclose(got_g, want_g, **tol)
    if ok_v and ok_g:
        return None
    if np.isfinite(got_g).all() and _as_close_as_plain(env, w, examples, got_v, got_g,
                                                       want_v, want_g):
        return None
    kind = "grad" if ok_v else "grad_value"
    return kind, f"{kind}: packed loss {got_v} grad {got_g.tolist()} != plain loss {want_v} grad {want_g.tolist()}"


def _as_close_as_plain(env, w, examples, got_v, got_g, want_v, want_g) -> bool:
    """Whether the packed loss and gradient are as close to plain JAX's in
    float64 as plain JAX's own float32 ones are (within 2x, plus the
    tolerance): near a singular derivative (``sqrt`` of a value near 0) two
    float32 orders of summation differ by more than any fixed tolerance."""
    import jax
    import jax.numpy as jnp
    with jax.enable_x64(True):
        vg = jax.value_and_grad(env["loss"])
        pairs = [vg(jnp.asarray(w, jnp.float64), jnp.asarray(x, jnp.float64)) for x in examples]
        ref_v = sum(float(v) for v, _ in pairs)
        ref_g = sum(np.asarray(g, np.float64) for _, g in pairs)
    if not (np.isfinite(ref_v) and np.isfinite(ref_g).all()):
        return False
    close = lambda got, want, ref: bool(np.all(
        np.abs(got - ref) <= 2 * np.abs(want - ref) + 1e-4 * (1 + np.abs(ref))))
    return close(got_v, want_v, ref_v) and close(got_g, want_g, ref_g)


# ----------------------------------------------------------------------------
# Runnable programs
# ----------------------------------------------------------------------------


def _lit(a) -> str:
    a = np.asarray(a)
    return f"np.array({a.tolist()!r}, np.{a.dtype}).reshape({a.shape!r})"


def repro(prog: Program, w, examples, mode: str, corrupted=None) -> str:
    head = (_PRELUDE + "\nimport polymask as pm\n\nnan, inf = np.nan, np.inf\n"
            f"RTOL = ATOL = {RTOL!r}\n\n\n" + _SAME_SRC + "\n\n" + prog.source() + "\n\n")
    data = (f"w = {_lit(w)}\nexamples = [\n"
            + "".join(f"    {_lit(x)},\n" for x in examples) + "]\n")
    rs = prog.row_size
    if mode == "grad":
        return (head + prog.loss_source() + "\n\n\n" + data +
                f"vg = pm.value_and_grad(loss, (None, \"n, 4\"), layout=\"packed\", reduce=\"sum\", "
                f"row_size={rs})\n"
                "got_v, got_g = vg(jnp.asarray(w), examples)\n"
                "pairs = [jax.value_and_grad(loss)(jnp.asarray(w), jnp.asarray(x)) for x in examples]\n"
                "want_v = sum(float(v) for v, _ in pairs)\n"
                "want_g = sum(np.asarray(g, np.float64) for _, g in pairs)\n"
                "print('packed', got_v, np.asarray(got_g).tolist())\n"
                "print('plain ', want_v, want_g.tolist())\n"
                "assert np.isfinite(want_g).all(), 'plain gradient not finite'\n"
                "assert np.allclose(got_v, want_v, rtol=1e-4, atol=1e-4), 'wrong loss'\n"
                "assert np.allclose(got_g, want_g, rtol=1e-4, atol=1e-4), 'wrong gradient'\n")
    return (head + "\n" + data + f"corrupted = {corrupted!r}  # the example holding NaN/inf\n"
            f"outs = pm.ragged_map(f, (\"n, 4\",), layout=\"packed\", row_size={rs})(examples, w)\n"
            "bad = []\n"
            "for i, (x, got) in enumerate(zip(examples, outs)):\n"
            "    want = f(jnp.asarray(w), jnp.asarray(x))\n"
            "    if not same(got, want):\n"
            "        bad.append(i)\n"
            "        print(f'example {i} (n = {len(x)}): packed', np.asarray(got).tolist(),\n"
            "              'plain', np.asarray(want).tolist())\n"
            "assert not bad, f'examples {bad} differ from plain JAX'\n")


# ----------------------------------------------------------------------------
# One program
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    status: str = "ok"  # ok | fail | refused | skip
    failures: list = dataclasses.field(default_factory=list)  # (kind, signature, msg)
    refusals: list = dataclasses.field(default_factory=list)  # primitives


def _examples(prog, rng):
    return [(rng.normal(size=(n, D)) * 0.6).astype(np.float32) for n in prog.sizes]


def _failing(prog, w, examples, mode, corrupted):
    """Re-run one check: its (kind, message) or None (shrinking)."""
    env = prog.namespace()
    try:
        if mode == "grad":
            keep, v, g = _plain_grads(env, w, examples)
            if len(keep) != len(examples):
                return None
            return _check_grads(prog, env, w, examples, v, g)
        want = _plain_all(env, w, examples)
        return _check_values(prog, env, w, examples, want, corrupted)
    except Refused:
        return None
    except Exception as e:
        return "error", f"{type(e).__name__}: {e}"


def shrink(prog, w, examples, mode, corrupted, kind, budget_s=20.0):
    """Drop ops (from the end, then single ones) and examples while the check
    still fails the same way; returns (prog, examples, corrupted)."""
    t0 = time.time()

    def still(p, ex, cor):
        if time.time() - t0 > budget_s:
            return False
        try:
            if len(p.ops) == 0 or p.min_n > min((len(x) for x in ex), default=0):
                return False
            r = _failing(p, w, ex, mode, cor)
        except Exception:
            return False
        return r is not None and r[0] == kind

    for j in reversed(range(len(prog.ops))):
        ops = prog.ops[:j] + prog.ops[j + 1:]
        kinds_ok = True
        k = "seq"
        for o in ops:
            kinds_ok &= k in o.kinds
            k = o.out or k
        if prog.head is not None and k not in prog.head.kinds:
            kinds_ok = False
        if kinds_ok and ops:
            cand = dataclasses.replace(prog, ops=ops)
            if still(cand, examples, corrupted):
                prog = cand
    i = 0
    while i < len(examples):
        if i == corrupted:
            i += 1
            continue
        ex = examples[:i] + examples[i + 1:]
        cor = None if corrupted is None else corrupted - (i < corrupted)
        if len(ex) >= 1 and still(prog, ex, cor):
            examples, corrupted = ex, cor
        else:
            i += 1
    return prog, examples, corrupted


def run_one(prog: Program, rng, checks=("values", "nan", "inf", "grad"), shrink_seen=None,
            verbose=False) -> Outcome:
    import polymask as pm

    out = Outcome()
    env = prog.namespace()
    f = env["f"]
    w = (rng.normal(size=(D, D)) * 0.5).astype(np.float32)
    need = prog.min_n
    all_examples = _examples(prog, rng)
    examples, raising = [], []
    bad_sizes = {n for n in set(prog.sizes) if n >= need and _plain_raises(f, w, n)}
    for x in all_examples:
        if len(x) >= need:  # plain JAX raising where the op table says it accepts: ShapeError
            (raising if len(x) in bad_sizes else examples).append(x)

    def fail(kind, msg, mode, ex, corrupted=None):
        sig = (kind, mode, prog.names())
        p, e, c = prog, ex, corrupted
        if shrink_seen is not None and sig not in shrink_seen and kind != "error":
            shrink_seen.add(sig)
            p, e, c = shrink(prog, w, ex, mode, corrupted, kind)
        text = (msg + "\n--- runnable program ---\n" + repro(p, w, e, mode, c))
        out.failures.append((kind, sig, p.names(), text))
        out.status = "fail"

    if raising:
        try:
            _packed_outputs(prog, env, w, [*examples[:1], raising[0]])
            fail("error", f"plain JAX raises at n = {len(raising[0])}, polymask did not",
                 "values", [*examples[:1], raising[0]])
        except pm.ShapeError:
            pass
        except Refused as r:
            out.refusals.append(r.primitive)
        except Exception as e:
            fail("error", f"plain JAX raises at n = {len(raising[0])}; polymask raised "
                 f"{type(e).__name__} (not ShapeError): {e}", "values",
                 [*examples[:1], raising[0]])
    if not examples:
        out.status = "skip"
        return out

    grad = ()
    if "grad" in checks and prog.head is not None and prog.kind in ANY:
        grad = range(len(examples))
    want, pairs = _plain_ref(env, w, examples, grad)
    for mode in checks:
        try:
            if mode == "values":
                r = _check_values(prog, env, w, examples, want)
                if r:
                    fail(*r, mode, examples)
            elif mode in ("nan", "inf"):
                i, ex = _corrupt(examples, rng, np.nan if mode == "nan" else np.inf,
                                 prog.nonfinite_min_n)
                if i is None:
                    continue
                want_c = list(want)
                want_c[i] = _plain_ref(env, w, ex, grad)[0][i]  # the same program
                r = _check_values(prog, env, w, ex, want_c, corrupted=i)
                if r:
                    fail(*r, mode, ex, i)
            elif mode == "grad":
                if not pairs:  # no head, or plain JAX cannot differentiate f
                    continue
                keep, v, g = _finite_grads(w, examples, pairs)
                if not keep:
                    continue
                r = _check_grads(prog, env, w, keep, v, g)
                if r:
                    fail(*r, mode, keep)
        except Refused as r:
            out.refusals.append(r.primitive)
            if mode != "grad":  # the value checks all refuse alike
                break
        except Exception as e:
            msg = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-4))
            fail("error", msg, mode, examples)
    if out.status == "ok" and out.refusals:
        out.status = "refused"
    return out


# ----------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------

FAIL_KINDS = {"value": "wrong_values", "grad": "wrong_grads", "grad_value": "wrong_grads",
              "crossed": "crossed", "error": "errors"}


_SEEN: set = set()  # failure signatures already shrunk (one set per worker process)


def _program(seed: int, i: int, shrink_failures: bool = True, seen: set | None = None) -> dict:
    """Program ``i`` of ``seed`` (its own RNG stream: the same program and data
    whichever process runs it), checked; plain values only (it crosses processes)."""
    rng = np.random.default_rng([seed, i])
    prog = random_program(rng)
    t1 = time.time()
    res = run_one(prog, rng, shrink_seen=(_SEEN if seen is None else seen)
                  if shrink_failures else None)
    return {"i": i, "status": res.status, "failures": res.failures, "refusals": res.refusals,
            "row_size": prog.row_size, "min_n": prog.min_n, "names": prog.names(),
            "seconds": time.time() - t1}


def _results(seed, programs, seconds, shrink_failures, jobs, t0, only=None):
    """The programs' results in order: in this process, or ``jobs`` spawned
    worker processes (each with its own JAX; the parent imports none).
    ``only``: these program indices instead of ``0, 1, ...``."""
    order = list(only) if only is not None else None

    def index(k):
        return order[k] if order is not None else k

    def more(k):
        return ((order is None or k < len(order)) and (programs is None or k < programs)
                and (seconds is None or time.time() - t0 <= seconds))

    if jobs <= 1:
        seen: set = set()
        k = 0
        while more(k):
            yield _program(seed, index(k), shrink_failures, seen)
            k += 1
        return
    import concurrent.futures
    import multiprocessing
    # workers live for the whole run: a recycled one would import the sources as
    # they are then, and one run would test two versions of polymask
    pool = concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"))
    pending = collections.deque()
    nxt = 0
    try:
        while True:
            while len(pending) < 2 * jobs and more(nxt):
                pending.append(pool.submit(_program, seed, index(nxt), shrink_failures))
                nxt += 1
            if not pending:
                return
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def run(seed: int = 0, programs: int | None = None, seconds: float | None = None,
        verbose: bool = True, shrink_failures: bool = True, jobs: int = 1,
        only: list[int] | None = None) -> dict:
    counts = collections.Counter()
    refusals = collections.Counter()
    failures = []
    t0 = time.time()
    n = 0
    for r in _results(seed, programs, seconds, shrink_failures, jobs, t0, only):
        i = r["i"]
        counts[r["status"]] += 1
        for kind, _sig, _names, _msg in r["failures"]:
            counts[FAIL_KINDS[kind]] += 1
        refusals.update(set(r["refusals"]))
        if verbose:
            extra = f" refused: {sorted(set(r['refusals']))}" if r["refusals"] else ""
            print(f"[{i}] {r['status']:7s} R={r['row_size']} min_n={r['min_n']} "
                  f"{r['seconds']:.2f}s: {r['names']}{extra}", flush=True)
            for kind, sig, names, msg in r["failures"]:
                print(textwrap.indent(f"{kind} ({sig[1]}; shrunk: {names}): {msg}", "    "),
                      flush=True)
        failures += [(i, *fl) for fl in r["failures"]]
        n += 1
    out = {"programs": n, "ok": counts["ok"], "skipped": counts["skip"],
           "refused_programs": counts["refused"],
           **{k: counts[k] for k in ("wrong_values", "wrong_grads", "crossed", "errors")},
           "refusals": sum(refusals.values()), "refusals_by_primitive": dict(refusals.most_common()),
           "seconds": round(time.time() - t0, 1)}
    out["failures"] = failures
    return out


def summary(res: dict) -> str:
    sigs = collections.Counter((k, s[1], n) for _, k, s, n, _ in res["failures"])
    lines = [f"{k:10s} {m:6s} x{c}: {n}" for (k, m, n), c in sorted(sigs.items())]
    return ("distinct failures (kind, check, shrunk program):\n  " + "\n  ".join(lines) + "\n"
            if lines else "") + (
        f"programs={res['programs']} ok={res['ok']} skipped={res['skipped']} "
        f"refused_programs={res['refused_programs']} wrong_values={res['wrong_values']} "
        f"wrong_grads={res['wrong_grads']} crossed={res['crossed']} errors={res['errors']} "
        f"refusals={res['refusals']} {res['refusals_by_primitive']} "
        f"seconds={res['seconds']} ({res['programs'] / max(res['seconds'], 1e-9):.2f} programs/s)")


def check_min_n(verbose=True) -> list:
    """Each op's min_n against plain JAX at sizes 0..5 (on an input of that size):
    the ops whose smallest accepted size differs."""
    bad = []
    w = np.eye(D, dtype=np.float32)
    for op in OPS:
        if "seq" not in op.kinds:
            continue
        p = Program([op], None, 8, [])
        f = p.namespace()["f"]
        ok = [n for n in range(6) if not _plain_raises(f, w, n)]  # shape errors: at trace
        first = ok[0] if ok else None
        if first != (op.min_n if op.plain_min is None else op.plain_min) or ok != list(range(first, 6)):
            bad.append((op.name, op.min_n, ok))
            if verbose:
                print(f"{op.name}: min_n={op.min_n}, plain accepts {ok}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--programs", type=int, default=None)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--only", type=int, nargs="+", metavar="I",
                   help="run these program indices of --seed only (a failure's [I] again)")
    p.add_argument("--quiet", action="store_true", help="print failures and the summary only")
    p.add_argument("--no-shrink", action="store_true")
    p.add_argument("--jobs", type=int, default=1,
                   help="worker processes (spawned; programs are independent, results print in "
                        "order): 2 on two free cores is about twice the programs per second")
    p.add_argument("--check-min-n", action="store_true",
                   help="check the op table's min_n against plain JAX and exit")
    p.add_argument("--full-compile", action="store_true",
                   help="keep XLA's default backend optimizations (default: off, as compiles "
                        "are most of the time; set before JAX starts)")
    a = p.parse_args(argv)
    if not a.full_compile:  # read when the backend starts, after this
        import os

        from polymask._jax_compat.versions import fast_compile_xla_flags
        os.environ["XLA_FLAGS"] = " ".join(
            [os.environ.get("XLA_FLAGS", ""), *fast_compile_xla_flags()]).strip()
    if a.check_min_n:
        return 1 if check_min_n() else 0
    if a.programs is None and a.seconds is None and a.only is None:
        a.programs = 50
    res = run(a.seed, a.programs, a.seconds, verbose=not a.quiet,
              shrink_failures=not a.no_shrink, jobs=a.jobs, only=a.only)
    if a.quiet:
        for i, kind, sig, names, msg in res["failures"]:
            print(f"[{i}] {kind} ({sig[1]}; {sig[2]}; shrunk: {names}):\n"
                  + textwrap.indent(msg, "    "), flush=True)
    print(summary(res), flush=True)
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
