"""Graph networks from jraph.

Source: https://github.com/google-deepmind/jraph (commit 51f5990),
jraph/_src/models.py (GraphNetwork, GAT, GraphConvolution) and
jraph/_src/utils.py (segment_sum, segment_mean, segment_variance,
segment_normalize, segment_max, segment_max_or_constant, segment_softmax).
License: Apache-2.0, Copyright 2020 DeepMind Technologies Limited.
Copied: only the code these programs need, single graphs as plain arrays
(``nodes (N, F)``, ``edges (E, F)``, ``senders``/``receivers (E,)``); N = n
nodes, E = 2n edges.
"""

import jax
import jax.numpy as jnp
from jax import lax

from .corpus import normal, params, program

SRC = "jraph https://github.com/google-deepmind/jraph/blob/51f5990/jraph/_src/"


# -- jraph/_src/utils.py ------------------------------------------------------------------------
def segment_sum(data, segment_ids, num_segments=None, indices_are_sorted=False,
                unique_indices=False):
    return jax.ops.segment_sum(data=data, segment_ids=segment_ids, num_segments=num_segments,
                               indices_are_sorted=indices_are_sorted,
                               unique_indices=unique_indices)


def segment_max(data, segment_ids, num_segments=None, indices_are_sorted=False,
                unique_indices=False):
    return jax.ops.segment_max(data, segment_ids, num_segments, indices_are_sorted,
                               unique_indices)


def segment_mean(data, segment_ids, num_segments=None):
    nominator = segment_sum(data, segment_ids, num_segments)
    denominator = segment_sum(jnp.ones_like(data), segment_ids, num_segments)
    return nominator / jnp.maximum(denominator, jnp.ones(shape=[], dtype=denominator.dtype))


def segment_variance(data, segment_ids, num_segments=None):
    means = segment_mean(data, segment_ids, num_segments)[segment_ids]
    counts = segment_sum(jnp.ones_like(data), segment_ids, num_segments)
    counts = jnp.maximum(counts, jnp.ones_like(counts))
    variances = segment_sum(jnp.power(data - means, 2), segment_ids, num_segments) / counts
    return variances


def segment_normalize(data, segment_ids, num_segments=None, eps=1e-8):
    means = segment_mean(data, segment_ids, num_segments)[segment_ids]
    variances = segment_variance(data, segment_ids, num_segments)[segment_ids]
    normalized = (data - means) * lax.rsqrt(jnp.maximum(
        variances, jnp.array(eps, dtype=variances.dtype)))
    return normalized


def _replace_empty_segments_with_constant(aggregated_segments, segment_ids, num_segments=None,
                                          constant=0.):
    result_shape = (len(segment_ids),) + aggregated_segments.shape[1:]
    num_elements_in_segment = segment_sum(
        jnp.ones(result_shape, dtype=jnp.int32), segment_ids, num_segments=num_segments)
    return jnp.where(num_elements_in_segment > 0, aggregated_segments,
                     jnp.array(constant, dtype=aggregated_segments.dtype))


def segment_max_or_constant(data, segment_ids, num_segments=None, constant=0.):
    maxs_ = segment_max(data, segment_ids, num_segments)
    return _replace_empty_segments_with_constant(maxs_, segment_ids, num_segments, constant)


def segment_softmax(logits, segment_ids, num_segments=None, indices_are_sorted=False,
                    unique_indices=False):
    maxs = segment_max(logits, segment_ids, num_segments, indices_are_sorted, unique_indices)
    logits = logits - maxs[segment_ids]
    logits = jnp.exp(logits)
    normalizers = segment_sum(logits, segment_ids, num_segments, indices_are_sorted,
                              unique_indices)
    normalizers = normalizers[segment_ids]
    softmax = logits / normalizers
    return softmax


# -- jraph/_src/models.py: GraphNetwork (single graph, no attention) --------------------------------
def graph_network(update_edge_fn, update_node_fn, update_global_fn,
                  nodes, edges, receivers, senders, globals_, n_node, n_edge):
    sum_n_node = nodes.shape[0]
    sum_n_edge = senders.shape[0]
    sent_attributes = nodes[senders]
    received_attributes = nodes[receivers]
    global_edge_attributes = jnp.repeat(globals_, n_edge, axis=0,
                                        total_repeat_length=sum_n_edge)
    edges = update_edge_fn(edges, sent_attributes, received_attributes, global_edge_attributes)
    sent_attributes = segment_sum(edges, senders, sum_n_node)
    received_attributes = segment_sum(edges, receivers, sum_n_node)
    global_attributes = jnp.repeat(globals_, n_node, axis=0, total_repeat_length=sum_n_node)
    nodes = update_node_fn(nodes, sent_attributes, received_attributes, global_attributes)
    n_graph = n_node.shape[0]
    graph_idx = jnp.arange(n_graph)
    node_gr_idx = jnp.repeat(graph_idx, n_node, axis=0, total_repeat_length=sum_n_node)
    edge_gr_idx = jnp.repeat(graph_idx, n_edge, axis=0, total_repeat_length=sum_n_edge)
    node_attributes = segment_sum(nodes, node_gr_idx, n_graph)
    edge_attributes = segment_sum(edges, edge_gr_idx, n_graph)
    globals_ = update_global_fn(node_attributes, edge_attributes, globals_)
    return nodes, edges, globals_


def _gn_params(rng):
    return (normal(rng, 3 + 4 + 4 + 2, 5, scale=0.3), normal(rng, 4 + 5 + 5 + 2, 4, scale=0.3),
            normal(rng, 4 + 5 + 2, 2, scale=0.3))


def gn_program(nodes, edges, senders, receivers, globals_, we, wn, wg):
    """One GraphNetwork step (MLP updates), as the jraph README's example graph."""
    n_node = jnp.array([nodes.shape[0]])  # one graph
    n_edge = jnp.array([senders.shape[0]])
    edge_fn = lambda e, s, r, g: jnp.tanh(jnp.concatenate([e, s, r, g], -1) @ we)
    node_fn = lambda n, s, r, g: jnp.tanh(jnp.concatenate([n, s, r, g], -1) @ wn)
    global_fn = lambda n, e, g: jnp.tanh(jnp.concatenate([n, e, g], -1) @ wg)
    return graph_network(edge_fn, node_fn, global_fn, nodes, edges, receivers, senders,
                         globals_, n_node, n_edge)


def _graph(n, rng, node_feats=4, edge_feats=3):
    e = 2 * n
    nodes = normal(rng, n, node_feats)
    edges = normal(rng, e, edge_feats)
    senders = rng.integers(0, max(n, 1), e).astype("int32")
    receivers = rng.integers(0, max(n, 1), e).astype("int32")
    return nodes, edges, senders, receivers


def _gn_example(n, rng):
    nodes, edges, senders, receivers = _graph(n, rng)
    g = params(1, lambda r: normal(r, 1, 2))
    return (nodes, edges, senders, receivers, g) + params(2, _gn_params)


# -- GAT -----------------------------------------------------------------------------------------
def gat(attention_query_fn, attention_logit_fn, nodes, receivers, senders, edges=None):
    node_update_fn = lambda x: jnp.reshape(jax.nn.leaky_relu(x), (x.shape[0], -1))
    sum_n_node = nodes.shape[0]
    nodes = attention_query_fn(nodes)
    sent_attributes = nodes[senders]
    received_attributes = nodes[receivers]
    softmax_logits = attention_logit_fn(sent_attributes, received_attributes, edges)
    weights = segment_softmax(softmax_logits, segment_ids=receivers, num_segments=sum_n_node)
    messages = sent_attributes * weights
    nodes = segment_sum(messages, receivers, num_segments=sum_n_node)
    return node_update_fn(nodes)


def _gat_params(rng):
    return normal(rng, 4, 2 * 3, scale=0.5), normal(rng, 2, 2 * 3, scale=0.5)


def gat_program(nodes, senders, receivers, wq, wa):
    """Two-head GAT layer (jraph.GAT with the paper's logit function)."""
    query = lambda x: (x @ wq).reshape(x.shape[0], 2, 3)

    def logit(s, r, e):
        cat = jnp.concatenate([s, r], -1)  # (E, 2, 6)
        return jax.nn.leaky_relu(jnp.einsum("ehf,hf->eh", cat, wa))[..., None]

    return gat(query, logit, nodes, receivers, senders)


def _gat_example(n, rng):
    nodes, _, senders, receivers = _graph(n, rng)
    return (nodes, senders, receivers) + params(3, _gat_params)


# -- GAT variant with mean aggregation over incoming edges (user report, issue #27) ---------------
def gat_degree_norm(nodes, senders, receivers, w, b):
    """Messages ``(x W + b) / in-degree[receiver]`` summed at the receivers: the
    count is gathered back to the edges (jraph.segment_mean written by hand)."""
    n = nodes.shape[0]
    x = nodes[senders] @ w
    deg = segment_sum(jnp.ones(senders.shape[0]), receivers, n)
    msg = (x + b) / deg[receivers][:, None]
    return jax.nn.relu(segment_sum(msg, receivers, n))


def _gdn_example(n, rng):
    nodes, _, senders, receivers = _graph(n, rng)
    return (nodes, senders, receivers) + params(4, lambda r: (normal(r, 4, 3), normal(r, 3)))


# -- GraphConvolution (GCN) with self edges and symmetric normalisation ---------------------------
def gcn_program(nodes, senders, receivers, w):
    nodes = nodes @ w
    total_num_nodes = nodes.shape[0]
    conv_receivers = jnp.concatenate((receivers, jnp.arange(total_num_nodes)), axis=0)
    conv_senders = jnp.concatenate((senders, jnp.arange(total_num_nodes)), axis=0)
    count_edges = lambda x: segment_sum(jnp.ones_like(conv_senders), x, total_num_nodes)
    sender_degree = count_edges(conv_senders)
    receiver_degree = count_edges(conv_receivers)
    nodes = nodes * jax.lax.rsqrt(jnp.maximum(sender_degree, 1.0))[:, None]
    nodes = segment_sum(nodes[conv_senders], conv_receivers, total_num_nodes)
    return nodes * jax.lax.rsqrt(jnp.maximum(receiver_degree, 1.0))[:, None]


def _gcn_example(n, rng):
    nodes, _, senders, receivers = _graph(n, rng)
    return (nodes, senders, receivers, params(5, lambda r: normal(r, 4, 3)))


# -- segment ops ---------------------------------------------------------------------------------
def segment_ops_program(nodes, edges, receivers):
    """segment_softmax and segment_normalize of edge features at their receivers."""
    n = nodes.shape[0]
    return (segment_softmax(edges, receivers, n), segment_normalize(edges, receivers, n))


def segment_max_const_program(nodes, edges, receivers):
    """segment_max_or_constant (jraph's NaN-safe max; uses ``len(segment_ids)``)."""
    return segment_max_or_constant(edges, receivers, nodes.shape[0])


def _seg_example(n, rng):
    nodes, edges, _, receivers = _graph(n, rng)
    return nodes, edges, receivers


GRAPH = ("n, 4", "e, 3", "e", "e")
PROGRAMS = [
    program(name="jraph_graph_network", source=SRC + "models.py GraphNetwork",
            license="Apache-2.0", fun=gn_program, in_specs=GRAPH + (None,) * 4,
            make_example=_gn_example, bound=6),
    program(name="jraph_gat", source=SRC + "models.py GAT", license="Apache-2.0",
            fun=gat_program, in_specs=("n, 4", "e", "e", None, None),
            make_example=_gat_example, bound=6),
    program(name="jraph_gat_degree_norm",
            source=SRC + "utils.py segment_sum (GAT mean-aggregation variant, issue #27 report)",
            license="Apache-2.0", fun=gat_degree_norm, in_specs=("n, 4", "e", "e", None, None),
            make_example=_gdn_example, bound=6),
    program(name="jraph_gcn", source=SRC + "models.py GraphConvolution", license="Apache-2.0",
            fun=gcn_program, in_specs=("n, 4", "e", "e", None), make_example=_gcn_example,
            bound=6),
    program(name="jraph_segment_softmax_normalize",
            source=SRC + "utils.py segment_softmax, segment_normalize", license="Apache-2.0",
            fun=segment_ops_program, in_specs=("n, 4", "e, 3", "e"),
            make_example=_seg_example, bound=6),
    program(name="jraph_segment_max_or_constant",
            source=SRC + "utils.py segment_max_or_constant", license="Apache-2.0",
            fun=segment_max_const_program, in_specs=("n, 4", "e, 3", "e"),
            make_example=_seg_example, bound=6),
]
