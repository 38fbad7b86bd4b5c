"""K-quant GGUFs of every supported architecture, written here from tiny mlx-lm models.

Each tiny random model is written the way llama.cpp's converter writes its
architecture (gguf-py's writer and HF -> GGUF tensor names, q/k permuted for
llama, Gemma norms stored + 1), quantized, imported, and run by mlx-lm.

Two checks per file:
- exact: the imported model's logits equal those of the source model with
  llama.cpp's own decoding of each tensor (gguf.quants.dequantize) put in,
  so the import adds no error of its own (float32: 1e-5 relative);
- within the quantization's error: the relative RMS logit error against the
  source stays under GAIN x WEIGHT_ERROR[type], where WEIGHT_ERROR is the
  type's relative RMS weight error on these weights (measured: Q2_K 0.33,
  Q3_K 0.155, Q4_K 0.078, Q5_K 0.038, Q6_K 0.019, IQ4_NL 0.080, Q8_0 0.0053)
  and GAIN how much the model amplifies weight noise (measured 2.1-2.9 for
  these 2-layer models; Gemma 3's 6 layers, norms and sliding window give up
  to 13).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx.errors import ImportFailedError
from omlx.models.gguf import convert_gguf
from tests.fixtures.gguf_files import perturb_norms, write_model_gguf
from tests.fixtures.tiny_models import build_tiny_model

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3"]
WEIGHT_ERROR = {
    Q.Q2_K: 0.35, Q.Q3_K: 0.17, Q.Q4_K: 0.085, Q.Q5_K: 0.042, Q.Q6_K: 0.021,
    Q.IQ4_NL: 0.088, Q.Q8_0: 0.006,
}  # fmt: skip
GAIN = {arch: 3.2 for arch in ARCHS} | {"gemma3": 15.0}
# llama.cpp's Q4_K_M recipe, in short: Q6_K for attn_v, ffn_down and the output head.
Q4_K_M = {".v_proj": Q.Q6_K, "down_proj": Q.Q6_K, "lm_head": Q.Q6_K, "default": Q.Q4_K}
TOKENS = mx.array([list(range(3, 200, 7))])  # 29 tokens: past Gemma 3's sliding window of 8


def logits(folder_or_model) -> np.ndarray:
    from mlx_lm import load

    model = load(str(folder_or_model))[0] if isinstance(folder_or_model, Path) else folder_or_model
    return np.array(model(TOKENS).astype(mx.float32))


def relative_error(got: np.ndarray, expected: np.ndarray) -> float:
    return float(np.sqrt(((got - expected) ** 2).mean() / (expected**2).mean()))


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    out = {}
    for arch in ARCHS:
        out[arch] = build_tiny_model(root / arch, f"gguf-{arch}")
        perturb_norms(out[arch])
    drop_lm_head(out["gemma3"])  # Gemma 3 ties its output head to the embedding
    return out


def drop_lm_head(folder: Path) -> None:
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["lm_head.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)


def decoded_model(source: Path, decoded: dict[str, np.ndarray]):
    """The source model with llama.cpp's decoding of every tensor of the file."""
    from mlx_lm import load

    model, _ = load(str(source))
    model.load_weights([(name, mx.array(w)) for name, w in decoded.items()])
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_imports_exactly_and_answers_within_q4_k_m_error(
    tmp_path: Path, sources: dict[str, Path], arch: str
) -> None:
    path = tmp_path / f"{arch}.Q4_K_M.gguf"
    decoded = write_model_gguf(sources[arch], path, Q4_K_M)

    result = convert_gguf(path, tmp_path / "f32", dtype="float32")
    kept = convert_gguf(path, tmp_path / "keep", dtype="keep")

    source, reference = logits(sources[arch]), logits(decoded_model(sources[arch], decoded))
    got = logits(result.path)
    assert relative_error(got, reference) < 1e-5
    error = relative_error(got, source)
    assert 0 < error < GAIN[arch] * WEIGHT_ERROR[Q.Q6_K] * 4  # Q4_K_M: mostly Q4_K (4x Q6_K's)
    # "keep": Q4_K is repacked exactly, Q6_K requantized at 8 bits (a quarter of its
    # step): what keeping adds is small against what the file already lost.
    assert relative_error(logits(kept.path), reference) < 0.25 * error
    assert kept.tensor_types["Q4_K"]["became"] == "kept as MLX 4-bit affine, group 32 (exact)"
    assert kept.tensor_types["Q6_K"]["became"] == "requantized to MLX 8-bit affine, group 32"
    config = json.loads((kept.path / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert result.architecture == {"mistral": "llama"}.get(arch, arch)


@pytest.mark.parametrize("kind", list(WEIGHT_ERROR), ids=lambda k: k.name)
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_each_quant_type_is_within_its_error(
    tmp_path: Path, sources: dict[str, Path], arch: str, kind: Q
) -> None:
    path = tmp_path / f"{arch}.{kind.name}.gguf"
    decoded = write_model_gguf(sources[arch], path, kind)
    source, reference = logits(sources[arch]), logits(decoded_model(sources[arch], decoded))

    got = logits(convert_gguf(path, tmp_path / "f32", dtype="float32").path)
    kept = convert_gguf(path, tmp_path / "keep", dtype="keep")

    assert relative_error(got, reference) < 1e-5
    bound = GAIN[arch] * WEIGHT_ERROR[kind]
    assert relative_error(got, source) < bound
    # Requantizing at +2 bits adds about a quarter of the source's error, in quadrature.
    keep_error = relative_error(logits(kept.path), source)
    assert keep_error < 1.05 * relative_error(got, source) + 0.01
    assert kept.tensor_types[kind.name]["tensors"] > 0


def test_gemma_configs_carry_what_the_file_says(tmp_path: Path, sources: dict[str, Path]) -> None:
    write_model_gguf(sources["gemma2"], tmp_path / "g2.gguf", Q.Q8_0)
    write_model_gguf(sources["gemma3"], tmp_path / "g3.gguf", Q.Q8_0)
    g2 = convert_gguf(tmp_path / "g2.gguf", tmp_path / "g2")
    g3 = convert_gguf(tmp_path / "g3.gguf", tmp_path / "g3")

    c2 = json.loads((g2.path / "config.json").read_text())
    c3 = json.loads((g3.path / "config.json").read_text())
    assert (c2["attn_logit_softcapping"], c2["final_logit_softcapping"]) == (50.0, 30.0)
    assert c2["query_pre_attn_scalar"] == 64 and c2["model_type"] == "gemma2"
    assert (c3["model_type"], c3["sliding_window"], c3["sliding_window_pattern"]) == (
        "gemma3_text",
        8,
        6,
    )
    assert c3["tie_word_embeddings"] is True


def test_partial_rope_phi3_keeps_its_rotary_fraction(tmp_path: Path) -> None:
    source = build_tiny_model(tmp_path / "src", "gguf-phi3", partial_rotary_factor=0.5)
    decoded = write_model_gguf(source, tmp_path / "p.gguf", Q.Q8_0)
    out = convert_gguf(tmp_path / "p.gguf", tmp_path / "out").path
    assert json.loads((out / "config.json").read_text())["partial_rotary_factor"] == 0.5
    assert relative_error(logits(out), logits(decoded_model(source, decoded))) < 1e-5


def test_partial_rope_is_refused_where_mlx_lm_lacks_it(tmp_path: Path) -> None:
    source = build_tiny_model(tmp_path / "src", "gguf-qwen3")
    write_model_gguf(source, tmp_path / "q.gguf", Q.Q8_0, rope_dims=32)
    with pytest.raises(ImportFailedError, match=r"rope\.dimension_count is 32 but head_dim is 64"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_shape_the_config_does_not_explain_is_refused(tmp_path: Path) -> None:
    # A file whose metadata says 8 heads of 32 where the tensors have 4 of 64.
    source = build_tiny_model(tmp_path / "src", "gguf-qwen3")
    write_model_gguf(source, tmp_path / "q.gguf", Q.Q8_0, head_dim=32)
    with pytest.raises(ImportFailedError, match=r"tensor model\.layers\.0\..* has shape"):
        convert_gguf(tmp_path / "q.gguf", tmp_path / "out")


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_llama_3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path) -> None:
    # Llama 3.1/3.2 GGUFs carry their RoPE scaling only as rope_freqs.weight.
    source = build_tiny_model(
        tmp_path / "src", "gguf-llama", rope_theta=500000.0, rope_scaling=LLAMA3_SCALING
    )
    decoded = write_model_gguf(source, tmp_path / "l3.gguf", Q.Q8_0)
    out = convert_gguf(tmp_path / "l3.gguf", tmp_path / "out").path
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == LLAMA3_SCALING
    assert relative_error(logits(out), logits(decoded_model(source, decoded))) < 1e-5


def test_rope_freqs_of_unknown_parameters_are_refused(tmp_path: Path) -> None:
    scaling = {**LLAMA3_SCALING, "high_freq_factor": 2.0}
    source = build_tiny_model(
        tmp_path / "src", "gguf-llama", rope_theta=500000.0, rope_scaling=scaling
    )
    write_model_gguf(source, tmp_path / "l3.gguf", Q.Q8_0)
    with pytest.raises(ImportFailedError, match=r"rope_freqs\.weight is not Llama 3's RoPE"):
        convert_gguf(tmp_path / "l3.gguf", tmp_path / "out")


def test_phi3_longrope_factors_become_its_rope_scaling(tmp_path: Path) -> None:
    # Phi-3 / 3.5 128k GGUFs carry LongRoPE as rope_factors_long/short tensors.
    rng = np.random.default_rng(0)
    long, short = (np.round(1 + rng.random(32) * 3, 3).tolist() for _ in range(2))
    scaling = {"type": "longrope", "long_factor": long, "short_factor": short}
    source = build_tiny_model(
        tmp_path / "src", "gguf-phi3", rope_scaling=scaling, original_max_position_embeddings=16
    )
    decoded = write_model_gguf(source, tmp_path / "p.gguf", Q.Q8_0)
    out = convert_gguf(tmp_path / "p.gguf", tmp_path / "out").path
    config = json.loads((out / "config.json").read_text())
    assert config["original_max_position_embeddings"] == 16
    assert config["rope_scaling"]["type"] == "longrope"
    np.testing.assert_allclose(config["rope_scaling"]["long_factor"], long, rtol=1e-6)
    assert relative_error(logits(out), logits(decoded_model(source, decoded))) < 1e-5
