"""GGUF import: a tiny random llama written the way llama.cpp writes it, then imported.

The GGUF side is built with the ``gguf`` package (llama.cpp's own writer and
reference quantizers), so the checks compare against llama.cpp's format, not
against our reading of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from omlx.errors import ImportFailedError
from omlx.models.gguf import import_gguf

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

HIDDEN, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, FFN = 64, 2, 4, 2, 128
HEAD_DIM = HIDDEN // NUM_HEADS
# <file_sep> is a control token with no bos/eos/unk/pad role (SmolLM2 has 14 such).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<file_sep>"]
# In the vocab but unreachable by merges: only Llama 3's ignore_merges finds it whole.
WHOLE_WORD = "Ġzzyzx"
BOS_ID, EOS_ID, EOT_ID = 1, 2, 0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog in 2024, not 1999.",
    "Numbers like 12345 and 3.14159 appear; so do words like café, naïve and Straße.",
    "Hello world! Hello again, world. The world says hello back 42 times.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
] * 20
ROUND_TRIP_TEXTS = [
    "Hello world 12345, then 3.14 and 2024!",
    "naïve café — Straße, 東京 and 🚀 (unseen bytes)",
    "  leading spaces\n\nnew lines\tand tabs  ",
    "<|im_start|>user\nhi there<|im_end|>\n<file_sep>x",
    "go to zzyzx road",
]
# Hugging Face's Llama 3 split regex, as in its tokenizer.json.
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF type per module, varied across layers so per-layer bits differ in "keep".
MIXED_TYPES = [
    dict(q=Q.Q4_0, k=Q.Q4_1, v=Q.Q8_0, o=Q.F16, gate=Q.Q4_1, up=Q.Q4_0, down=Q.Q8_0),
    dict(q=Q.Q8_0, k=Q.Q4_0, v=Q.F32, o=Q.Q4_1, gate=Q.F16, up=Q.Q8_0, down=Q.Q4_0),
]
F32_TYPES = [dict.fromkeys(MIXED_TYPES[0], Q.F32) for _ in range(NUM_LAYERS)]

_HF_TO_GGUF = {
    "self_attn.q_proj": ("attn_q", "q"),
    "self_attn.k_proj": ("attn_k", "k"),
    "self_attn.v_proj": ("attn_v", "v"),
    "self_attn.o_proj": ("attn_output", "o"),
    "mlp.gate_proj": ("ffn_gate", "gate"),
    "mlp.up_proj": ("ffn_up", "up"),
    "mlp.down_proj": ("ffn_down", "down"),
    "input_layernorm": ("attn_norm", None),
    "post_attention_layernorm": ("ffn_norm", None),
}


# ---------------------------------------------------------------- source model


def train_tokenizer(pre: str) -> Tokenizer:
    """A byte-level BPE with ``pre``'s pre-tokenizer, as its tokenizer.json would set it.

    Merges are learned with plain GPT-2 splitting, so the vocab holds digit
    merges ("12") that only a correct pre-tokenizer keeps from being used.
    """
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    data = json.loads(tokenizer.to_str())
    data["model"]["vocab"][WHOLE_WORD] = len(data["model"]["vocab"])
    data["model"]["ignore_merges"] = pre == "llama-bpe"  # as Llama 3's tokenizer.json
    tokenizer = Tokenizer.from_str(json.dumps(data))
    if pre == "smollm":  # SmolLM2's tokenizer.json: digits one by one, then GPT-2 bytes
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "llama-bpe":
        split = pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated")
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, no_regex])
    return tokenizer


def random_weights(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def w(rows: int, cols: int, std: float = 0.15) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * std).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": w(vocab_size, HIDDEN, 1.0),
        "model.norm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32),
        "lm_head.weight": w(vocab_size, HIDDEN),
    }
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": w(NUM_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": w(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": w(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, NUM_HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
            p + "input_layernorm.weight": (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(
                np.float32
            ),
            p + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        }
    return weights


# llama.cpp's convert_hf_to_gguf.py permutes q/k rows from HF's half-split RoPE
# layout to the interleaved one; unpermute is its inverse.
def permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


# ---------------------------------------------------------------- GGUF writer


def gguf_tensors(
    weights: dict[str, np.ndarray],
    types: list[dict],
    *,
    tied: bool,
    embed_type: Q = Q.Q8_0,
    head_type: Q = Q.Q4_1,
) -> list[tuple[str, np.ndarray, Q, str]]:
    """(gguf name, GGUF-side float tensor, type, HF name) in llama.cpp's layout."""
    embed, norm = "model.embed_tokens.weight", "model.norm.weight"
    out = [
        ("token_embd.weight", weights[embed], embed_type, embed),
        ("output_norm.weight", weights[norm], Q.F32, norm),
    ]
    if not tied:
        out.append(("output.weight", weights["lm_head.weight"], head_type, "lm_head.weight"))
    for i in range(NUM_LAYERS):
        for hf_part, (gguf_part, key) in _HF_TO_GGUF.items():
            hf_name = f"model.layers.{i}.{hf_part}.weight"
            tensor = weights[hf_name]
            if key == "q":
                tensor = permute(tensor, NUM_HEADS)
            elif key == "k":
                tensor = permute(tensor, NUM_KV_HEADS)
            kind = types[i][key] if key else Q.F32
            out.append((f"blk.{i}.{gguf_part}.weight", tensor, kind, hf_name))
    return out


def write_gguf(
    path: Path,
    tokenizer: Tokenizer,
    tensors: list[tuple[str, np.ndarray, Q, str]],
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    pre: str = "smollm",
    add_bos: bool = False,
    extra: list[tuple[str, np.ndarray, Q]] = (),
    chat_template: str = CHAT_TEMPLATE,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_vocab_size(tokenizer.get_vocab_size())
    _add_tokenizer(writer, tokenizer, tokenizer_model, pre, add_bos, chat_template)
    for name, tensor, kind, *_ in [*tensors, *extra]:
        if kind == Q.I8:
            data = tensor.astype(np.int8)
        else:
            data = tensor if kind == Q.F32 else gguf.quants.quantize(tensor, kind)
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_tokenizer(
    writer, tokenizer: Tokenizer, model: str, pre: str, add_bos: bool, chat_template: str
) -> None:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    tokens = [token for token, _ in vocab]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in merges])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_eot_token_id(EOT_ID)
    writer.add_unk_token_id(EOT_ID)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(chat_template)


def llama_cpp_decode(tensor: np.ndarray, kind: Q) -> np.ndarray:
    """Quantize and decode with llama.cpp's reference code (gguf-py)."""
    if kind == Q.F32:
        return tensor
    return gguf.quants.dequantize(gguf.quants.quantize(tensor, kind), kind)


def decode_reference(tensors: list[tuple[str, np.ndarray, Q, str]]) -> dict[str, np.ndarray]:
    """What the file holds, decoded by llama.cpp's reference code, back in HF layout."""
    ref = {}
    for _, tensor, kind, hf_name in tensors:
        value = llama_cpp_decode(tensor, kind)
        if "q_proj" in hf_name:
            value = unpermute(value, NUM_HEADS)
        elif "k_proj" in hf_name:
            value = unpermute(value, NUM_KV_HEADS)
        ref[hf_name] = value.astype(np.float32)
    return ref


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer("smollm")


@pytest.fixture(scope="module")
def weights(tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    return random_weights(tokenizer.get_vocab_size())


@pytest.fixture
def mixed_gguf(tmp_path: Path, tokenizer, weights) -> Path:
    return write_gguf(
        tmp_path / "tiny.gguf", tokenizer, gguf_tensors(weights, MIXED_TYPES, tied=False)
    )


def reference_logits(ref: dict[str, np.ndarray], tokens: list[int], *, tied: bool) -> np.ndarray:
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": HIDDEN, "num_hidden_layers": NUM_LAYERS,
        "intermediate_size": FFN, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "vocab_size": ref["model.embed_tokens.weight"].shape[0],
        "tie_word_embeddings": tied, "rope_traditional": False,
    })  # fmt: skip
    model = llama.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in ref.items() if not (tied and "lm_head" in k)])
    return np.array(model(mx.array([tokens])).astype(mx.float32))


def imported_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    from mlx_lm import load

    model, _ = load(str(folder))
    return np.array(model(mx.array([tokens])).astype(mx.float32))


TOKENS = [5, 17, 33, 2, 9, 100, 42, 7, 250, 3]


# ---------------------------------------------------------------- model


@pytest.mark.parametrize("types", [F32_TYPES, MIXED_TYPES], ids=["f32", "mixed-quant"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_match_the_source_model(tmp_path, tokenizer, weights, types, tied):
    if types is F32_TYPES:
        tensors = gguf_tensors(weights, types, tied=tied, embed_type=Q.F32, head_type=Q.F32)
    else:
        tensors = gguf_tensors(weights, types, tied=tied)
    path = write_gguf(tmp_path / "m.gguf", tokenizer, tensors)
    ref = decode_reference(tensors)
    if types is F32_TYPES:  # nothing lossy: the reference is the original model itself
        assert all(np.array_equal(ref[k], weights[k]) for k in ref)

    out = import_gguf(path, tmp_path / "model", dtype="float32")

    expected = reference_logits(ref, TOKENS, tied=tied)
    got = imported_logits(out, TOKENS)
    assert np.abs(expected).max() > 1.0  # logits big enough for the tolerance to mean something
    np.testing.assert_allclose(got, expected, atol=2e-4 * np.abs(expected).max(), rtol=0)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tied


@pytest.mark.parametrize("dtype, tolerance", [("float16", 2e-2), ("keep", 5e-3)])
def test_float16_and_quantized_folders_give_the_same_logits(
    tmp_path, mixed_gguf, tokenizer, weights, dtype, tolerance
):
    ref = decode_reference(gguf_tensors(weights, MIXED_TYPES, tied=False))
    expected = reference_logits(ref, TOKENS, tied=False)

    got = imported_logits(import_gguf(mixed_gguf, tmp_path / "model", dtype=dtype), TOKENS)

    np.testing.assert_allclose(got, expected, atol=tolerance * np.abs(expected).max(), rtol=0)


def test_dequantized_weights_match_originals_within_quantization_error(
    tmp_path, mixed_gguf, weights
):
    out = import_gguf(mixed_gguf, tmp_path / "model", dtype="float32")
    saved = mx.load(str(out / "model.safetensors"))
    tensors = gguf_tensors(weights, MIXED_TYPES, tied=False)
    # Bound on |error| relative to the tensor's largest value, per GGUF type.
    bound = {Q.F32: 0.0, Q.F16: 1e-3, Q.Q8_0: 1 / 120, Q.Q4_1: 1 / 14, Q.Q4_0: 1 / 7}

    assert len(saved) == len(tensors)
    for gguf_name, tensor, kind, hf_name in tensors:
        got = np.array(saved[hf_name])
        assert got.dtype == np.float32, hf_name
        exact = llama_cpp_decode(tensor, kind)
        np.testing.assert_allclose(got, exact, atol=1e-6, rtol=1e-6, err_msg=gguf_name)
        assert np.abs(got - tensor).max() <= bound[kind] * np.abs(tensor).max(), gguf_name


def test_keep_writes_per_layer_quantization(tmp_path, mixed_gguf):
    out = import_gguf(mixed_gguf, tmp_path / "model", dtype="keep")
    config = json.loads((out / "config.json").read_text())
    quant = config["quantization"]
    saved = mx.load(str(out / "model.safetensors"))

    assert quant["group_size"] == 32 and quant["bits"] == 4  # 4-bit tensors are the majority
    assert quant["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert quant["model.layers.0.self_attn.v_proj"] == {"group_size": 32, "bits": 8}
    assert "model.layers.0.self_attn.q_proj" not in quant  # default bits
    assert "model.layers.0.self_attn.o_proj.scales" not in saved  # F16 stays a float tensor
    assert saved["model.layers.0.self_attn.o_proj.weight"].dtype == mx.float16
    assert saved["model.layers.1.self_attn.q_proj.weight"].dtype == mx.uint32


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("pre, add_bos", [("smollm", False), ("gpt2", False), ("llama-bpe", True)])
def test_tokenizer_round_trips_like_the_source(tmp_path, weights, pre, add_bos):
    from transformers import AutoTokenizer

    source = train_tokenizer(pre)
    tensors = gguf_tensors(random_weights(source.get_vocab_size()), F32_TYPES, tied=True)
    path = write_gguf(tmp_path / "m.gguf", source, tensors, pre=pre, add_bos=add_bos)
    loaded = AutoTokenizer.from_pretrained(str(import_gguf(path, tmp_path / "model")))

    for text in ROUND_TRIP_TEXTS:
        ids = loaded.encode(text, add_special_tokens=False)
        assert ids == source.encode(text).ids, text
        assert loaded.decode(ids) == text
    with_specials = loaded.encode("hi")
    assert (with_specials[0] == BOS_ID) is add_bos
    assert with_specials.count(BOS_ID) == int(add_bos)
    if pre == "smollm":  # the vocab has digit merges, yet digits stay one token each
        assert any(len(t) > 1 and t.isdigit() for t in source.get_vocab())
        assert len(loaded.encode("2024", add_special_tokens=False)) == 4
    if pre == "llama-bpe":
        assert loaded.encode(" zzyzx", add_special_tokens=False) == [source.token_to_id(WHOLE_WORD)]


def test_chat_template_and_special_tokens_are_carried(tmp_path, mixed_gguf):
    from mlx_lm import load

    out = import_gguf(mixed_gguf, tmp_path / "model", dtype="keep")
    _, tok = load(str(out))
    messages = [{"role": "user", "content": "Hi"}]

    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [EOS_ID]
    assert set(tok.eos_token_ids) >= {EOS_ID, EOT_ID}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [
        EOS_ID,
        EOT_ID,
    ]
    special_map = json.loads((out / "special_tokens_map.json").read_text())
    assert special_map["bos_token"] == "<|im_start|>" and special_map["eos_token"] == "<|im_end|>"


# ---------------------------------------------------------------- errors


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    with pytest.raises(ImportFailedError, match="not a GGUF file"):
        import_gguf(path, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_truncated_file(tmp_path, mixed_gguf):
    data = mixed_gguf.read_bytes()
    for size in (len(data) - 100, 2000, 12):
        cut = tmp_path / f"cut-{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ImportFailedError, match="truncated"):
            import_gguf(cut, tmp_path / "model")


def test_unsupported_architecture(tmp_path, tokenizer, weights):
    tensors = gguf_tensors(weights, F32_TYPES, tied=True)
    path = write_gguf(tmp_path / "m.gguf", tokenizer, tensors, arch="mamba")
    with pytest.raises(ImportFailedError, match="architecture 'mamba' is not supported"):
        import_gguf(path, tmp_path / "model")


def test_unsupported_tokenizer_model(tmp_path, tokenizer, weights):
    tensors = gguf_tensors(weights, F32_TYPES, tied=True)
    path = write_gguf(tmp_path / "m.gguf", tokenizer, tensors, tokenizer_model="rwkv")
    with pytest.raises(ImportFailedError, match="tokenizer model 'rwkv' is not supported"):
        import_gguf(path, tmp_path / "model")


def test_unsupported_pre_tokenizer(tmp_path, tokenizer, weights):
    tensors = gguf_tensors(weights, F32_TYPES, tied=True)
    path = write_gguf(tmp_path / "m.gguf", tokenizer, tensors, pre="deepseek-coder")
    with pytest.raises(ImportFailedError, match="pre-tokenizer 'deepseek-coder'"):
        import_gguf(path, tmp_path / "model")


def test_unsupported_tensor_type(tmp_path, tokenizer, weights):
    # Integer tensors hold no model weights gguf.quants can decode.
    types = [dict(t, up=Q.I8) for t in F32_TYPES]
    path = write_gguf(tmp_path / "m.gguf", tokenizer, gguf_tensors(weights, types, tied=True))
    with pytest.raises(
        ImportFailedError, match=r"blk\.0\.ffn_up\.weight has type I8, which cannot"
    ):
        import_gguf(path, tmp_path / "model")


def test_tensor_without_mlx_counterpart(tmp_path, tokenizer, weights):
    tensors = gguf_tensors(weights, F32_TYPES, tied=True)
    extra = [("blk.0.ffn_gate_exps.weight", np.ones((2, HEAD_DIM), np.float32), Q.F32)]
    path = write_gguf(tmp_path / "m.gguf", tokenizer, tensors, extra=extra)
    with pytest.raises(ImportFailedError, match=r"ffn_gate_exps\.weight has no counterpart"):
        import_gguf(path, tmp_path / "model")


def test_existing_folder_is_kept_unless_overwrite(tmp_path, mixed_gguf):
    out = tmp_path / "model"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")

    with pytest.raises(ImportFailedError, match="already exists"):
        import_gguf(mixed_gguf, out)
    assert (out / "mine.txt").read_text() == "keep me"

    import_gguf(mixed_gguf, out, dtype="keep", overwrite=True)
    assert not (out / "mine.txt").exists()
    assert (out / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "tiny.gguf"]


def test_failed_write_leaves_no_folder(tmp_path, mixed_gguf, monkeypatch):
    def disk_full(path, *args, **kwargs):
        Path(path).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    with pytest.raises(ImportFailedError, match="No space left on device"):
        import_gguf(mixed_gguf, tmp_path / "model")
    # Neither the model folder nor its hidden temp folder is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def test_bad_dtype(tmp_path, mixed_gguf):
    with pytest.raises(ImportFailedError, match="dtype must be one of"):
        import_gguf(mixed_gguf, tmp_path / "model", dtype="int4")
