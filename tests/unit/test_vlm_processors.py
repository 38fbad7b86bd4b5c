"""omlx's processors where mlx-vlm's needs PyTorch (models/vlm_processors.py).

The stand-in for the torch backend: transformers' torchvision Siglip2ImageProcessor
cannot run here (omlx installs no torch), so the PIL backend's pixels are checked by
hand against the torch code's logic. Both backends' ``_preprocess`` take the same
steps (the size search get_image_size_for_max_num_patches, rescale and normalize,
convert_image_to_patches' permute(1, 3, 2, 4, 0), pad_along_first_dim's zero rows and
int32 mask); only the resize kernel differs, and transformers' own
test_slow_fast_equivalence holds the two within atol 0.1 (mean 2e-3). An image
already at its target size is resized to itself by both, so there the arrays must be
the torch code's exactly: its patch grid, each patch's pixels row-major with channels
innermost, normalized, then zero rows to the budget with the mask marking them.

mistral_large3's refusal is checked here too: its processor needs torch as well, and
with a torch-free one in its place mlx-vlm's model still answers without the image.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from omlx.models.vlm_processors import served_processor
from tests.fixtures.tiny_models import train_tokenizer
from tests.fixtures.tiny_vlm_configs_notorch import phi4_siglip


def _folder(tmp_path: Path, **fields: Any) -> tuple[Path, Any]:
    """A tiny phi4_siglip folder's config (its 36-patch budget; ``fields`` replaced)
    and the tokenizer mlx-vlm's load falls back to there."""
    from transformers import AutoTokenizer

    vocab = train_tokenizer(tmp_path)
    config = {**phi4_siglip(vocab, -1, 96)[0], **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, AutoTokenizer.from_pretrained(tmp_path)


def test_a_naflex_phi4_siglip_gets_mlx_vlms_processor_on_the_pil_siglip2(tmp_path: Path) -> None:
    from mlx_vlm.models.phi4_siglip.processing_phi4_siglip import Phi4SigLipProcessor
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        Siglip2ImageProcessorPil,
    )

    folder, tokenizer = _folder(tmp_path)
    processor = served_processor("phi4-siglip", folder, tokenizer)
    assert isinstance(processor, Phi4SigLipProcessor) and processor.tokenizer is tokenizer
    image_processor = processor.image_processor
    assert isinstance(image_processor, Siglip2ImageProcessorPil)
    # The arguments mlx-vlm gives the torch Siglip2ImageProcessor (config.json's).
    assert (image_processor.patch_size, image_processor.max_num_patches) == (16, 36)
    assert image_processor.min_num_patches == 4
    assert list(image_processor.image_mean) == list(image_processor.image_std) == [0.5] * 3


def test_a_processor_mlx_vlm_built_is_served_as_it_is(tmp_path: Path) -> None:
    folder, tokenizer = _folder(tmp_path, mm_vision_tower="google/siglip-so400m-patch14-384")
    # Not NaFlex: mlx-vlm's other branch needs no torch, and its load's result stays.
    assert served_processor("phi4_siglip", folder, tokenizer) is tokenizer
    assert served_processor("llava", folder, tokenizer) is tokenizer


@pytest.mark.parametrize("budget", [6, 9])
def test_the_pil_siglip2_pixels_are_the_torch_codes_by_hand(tmp_path: Path, budget: int) -> None:
    # 32x48 pixels: 2x3 patches of 16, the largest grid of its aspect within 6 or 9
    # patches (the next, 3x4, is 12), so both backends resize it to itself.
    folder, tokenizer = _folder(tmp_path, max_num_patches=budget)
    processor = served_processor("phi4_siglip", folder, tokenizer)
    pixels = np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)
    out = processor.image_processor(Image.fromarray(pixels), return_tensors="np")
    assert out["spatial_shapes"].tolist() == [[2, 3]]
    normalized = (pixels.astype(np.float32) / 255 - 0.5) / 0.5
    patches = [
        normalized[r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16].reshape(-1)
        for r in range(2)
        for c in range(3)
    ]
    expected = np.zeros((1, budget, 16 * 16 * 3), np.float32)
    expected[0, :6] = np.stack(patches)
    assert out["pixel_values"].shape == expected.shape
    np.testing.assert_allclose(out["pixel_values"], expected, atol=1e-6)
    assert out["pixel_attention_mask"].tolist() == [[1] * 6 + [0] * (budget - 6)]
    assert out["pixel_attention_mask"].dtype == np.int32


@pytest.fixture(scope="module")
def tiny_mistral_large3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.fixtures.tiny_vlms import build_tiny_vlm

    folder = tmp_path_factory.mktemp("tiny-mistral-large3")
    return build_tiny_vlm(folder, "mistral_large3", image_size=56)


def test_mistral_large3_is_refused_while_mlx_vlms_load_needs_torch(
    tiny_mistral_large3: Path,
) -> None:
    # vlm_refusals.REFUSED's reason, checked: mlx-vlm registers no processor of its own
    # for mistral_large3, so its load takes the checkpoint's PixtralProcessor from
    # transformers, which needs torch.
    import importlib

    from mlx_vlm import load

    from omlx.models.vlm_families import FAMILIES
    from omlx.models.vlm_refusals import REFUSED

    with pytest.raises(ImportError, match="PixtralProcessor requires the Torchvision"):
        load(str(tiny_mistral_large3))
    with pytest.raises(ImportError, match="torch"):
        importlib.import_module("transformers.models.pixtral.processing_pixtral")
    assert "mistral_large3" in REFUSED and "mistral_large3" not in FAMILIES


class _PixtralOnPil:
    """transformers' PixtralProcessor torch-free, for mlx-vlm's processor hook:
    mlx-vlm's own port of it (Mistral3Processor: the same [IMG] rows, [IMG_BREAK],
    [IMG_END]) over transformers' PIL PixtralImageProcessor, with
    processor_config.json's arguments."""

    @staticmethod
    def from_pretrained(path: str, **kwargs: Any) -> Any:
        from mlx_vlm.models.base import load_chat_template
        from mlx_vlm.models.mistral3.processing_mistral3 import Mistral3Processor
        from transformers import AutoTokenizer
        from transformers.models.pixtral.image_processing_pil_pixtral import (
            PixtralImageProcessorPil,
        )

        tokenizer = load_chat_template(AutoTokenizer.from_pretrained(path), path)
        fields = json.loads((Path(path) / "processor_config.json").read_text())
        return Mistral3Processor(
            PixtralImageProcessorPil.from_pretrained(path),
            tokenizer,
            patch_size=fields["patch_size"],
            spatial_merge_size=fields["spatial_merge_size"],
        )


def test_mlx_vlms_mistral_large3_answers_every_image_alike(
    tiny_mistral_large3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # REFUSED's other reason, checked with the processor mlx-vlm's load would build
    # (transformers' torch PixtralProcessor cannot run here: _PixtralOnPil stands in,
    # registered by the hook mlx-vlm's pixtral and mistral3 packages register theirs
    # by): the vision path fills the image tokens' rows with different features for two
    # images, but mlx-vlm's decoder (deepseek_v3's LanguageModel) takes inputs_embeds
    # and runs on the token ids alone, so its own generate answers both images alike,
    # logprobs and all. A new mlx-vlm whose decoder reads them fails here: try the family.
    from mlx_vlm import load, stream_generate
    from mlx_vlm.models.base import install_auto_processor_patch
    from mlx_vlm.utils import prepare_inputs
    from transformers import AutoProcessor

    # The hook replaces AutoProcessor.from_pretrained; monkeypatch puts it back.
    monkeypatch.setattr(AutoProcessor, "from_pretrained", AutoProcessor.__dict__["from_pretrained"])
    install_auto_processor_patch("mistral_large3", _PixtralOnPil)
    model, processor = load(str(tiny_mistral_large3))
    prompt = "<|im_start|>user\ndescribe it[IMG]<|im_end|>\n<|im_start|>assistant\n"
    rows, answers = [], []
    for seed in (1, 2):
        image = tmp_path / f"{seed}.png"
        pixels = np.random.default_rng(seed).integers(0, 256, (40, 50, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(image)
        inputs = prepare_inputs(processor, images=[str(image)], prompts=prompt)
        embedded = model.get_input_embeddings(
            inputs["input_ids"], inputs["pixel_values"], image_sizes=inputs["image_sizes"]
        )
        rows.append(np.array(embedded.inputs_embeds))
        pieces = stream_generate(
            model, processor, prompt, image=[str(image)], max_tokens=5, temperature=0.0
        )
        answers.append([(p.token, float(p.logprobs[p.token])) for p in pieces])
    # The images' rows differ as much as the token embeddings' size (~0.3) itself.
    assert np.abs(rows[0] - rows[1]).max() > 0.1
    assert len(answers[0]) >= 5 and answers[0] == answers[1]
