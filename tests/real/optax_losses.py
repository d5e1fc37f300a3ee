"""optax losses, assignment and an optimizer step, called from the installed optax.

Source: https://github.com/google-deepmind/optax (optax 0.2.8, as installed):
optax.ctc_loss, optax.losses.ntxent, optax.softmax_cross_entropy_with_integer_labels,
optax.losses.ranking_softmax_loss, optax.sigmoid_focal_loss,
optax.assignment.hungarian_algorithm, optax.chain(clip_by_global_norm, adamw).
License: Apache-2.0, Copyright 2019 DeepMind Technologies Limited.
The programs call optax itself (an allowed dependency); only the wrappers that
turn one example into arrays with a variable-size axis are ours.
"""

import jax.numpy as jnp
import numpy as np
import optax

from .corpus import normal, program

SRC = "optax https://github.com/google-deepmind/optax/blob/v0.2.8/optax/"
K = 5  # classes (CTC: blank = 0)


def ctc_program(logits, logit_paddings, labels, label_paddings):
    """CTC loss of one utterance: logits (1, T, K), labels (1, L); T = 2n+1, L = n."""
    return optax.ctc_loss(logits, logit_paddings, labels, label_paddings)


def _ctc_example(n, rng):
    t, ell = 2 * n + 1, n
    return (normal(rng, 1, t, K), np.zeros((1, t), np.float32),
            rng.integers(1, K, (1, ell)).astype(np.int32), np.zeros((1, ell), np.float32))


def ntxent_program(embeddings, labels):
    """NT-Xent (SimCLR) loss over n embeddings; labels pair them up."""
    return optax.losses.ntxent(embeddings, labels)


def _ntxent_example(n, rng):
    return normal(rng, n, 6), (np.arange(n) // 2).astype(np.int32)


def xent_program(logits, labels):
    """Token-level softmax cross entropy, mean over the sequence."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _xent_example(n, rng):
    return normal(rng, n, K), rng.integers(0, K, n).astype(np.int32)


def ranking_program(logits, labels):
    """Listwise ranking softmax loss of one list of n items."""
    return optax.losses.ranking_softmax_loss(logits, labels)


def _ranking_example(n, rng):
    return normal(rng, n), (rng.random(n) < 0.5).astype(np.float32)


def focal_program(logits, labels):
    """Sigmoid focal loss (RetinaNet), summed over n anchors and normalised by n."""
    return jnp.sum(optax.sigmoid_focal_loss(logits, labels)) / logits.shape[0]


def _focal_example(n, rng):
    return normal(rng, n, 3), (rng.random((n, 3)) < 0.3).astype(np.float32)


def hungarian_program(cost):
    """Optimal assignment of an n x n cost matrix (DETR's matcher)."""
    i, j = optax.assignment.hungarian_algorithm(cost)
    return i, j, cost[i, j].sum()


def _hungarian_example(n, rng):
    return (rng.random((n, n)).astype(np.float32),)


def adamw_program(params, grads):
    """One clip_by_global_norm + AdamW step on a parameter vector of length n (embedding rows)."""
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-2))
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates)


def _adamw_example(n, rng):
    return normal(rng, n, 4), normal(rng, n, 4)


PROGRAMS = [
    program(name="optax_ctc_loss", source=SRC + "losses/_classification.py ctc_loss",
            license="Apache-2.0", fun=ctc_program,
            in_specs=("1, t, 5", "1, t", "1, l", "1, l"), make_example=_ctc_example,
            bound=6),
    program(name="optax_ntxent", source=SRC + "losses/_self_supervised.py ntxent",
            license="Apache-2.0", fun=ntxent_program, in_specs=("n, 6", "n"),
            make_example=_ntxent_example, bound=8),
    program(name="optax_softmax_xent",
            source=SRC + "losses/_classification.py softmax_cross_entropy_with_integer_labels",
            license="Apache-2.0", fun=xent_program, in_specs=("n, 5", "n"),
            make_example=_xent_example, bound=8),
    program(name="optax_ranking_softmax", source=SRC + "losses/_ranking.py ranking_softmax_loss",
            license="Apache-2.0", fun=ranking_program, in_specs=("n", "n"),
            make_example=_ranking_example, bound=8),
    program(name="optax_sigmoid_focal", source=SRC + "losses/_classification.py sigmoid_focal_loss",
            license="Apache-2.0", fun=focal_program, in_specs=("n, 3", "n, 3"),
            make_example=_focal_example, bound=8),
    program(name="optax_hungarian",
            source=SRC + "assignment/_hungarian_algorithm.py hungarian_algorithm",
            license="Apache-2.0", fun=hungarian_program, in_specs=("n, n",),
            make_example=_hungarian_example, bound=2, sizes=(0, 1, 2), pmjit_sizes=(1, 2),
            timeout=40, note="the reported 1x1 cost padded to 2x2"),
    program(name="optax_adamw_clip_step", source=SRC + "transforms/_clipping.py, _adding.py adamw",
            license="Apache-2.0", fun=adamw_program, in_specs=("n, 4", "n, 4"),
            make_example=_adamw_example, bound=8),
]
