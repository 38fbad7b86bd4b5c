"""phi3_v's numbered images (vlm_families.hd_crop_rows, Family.numbered_images): the
rows omlx expects of each image are those mlx-vlm's processor writes, at the
checkpoint's own crop counts (the tiny model of tests/api/test_vision_families.py
takes 2)."""

from __future__ import annotations

import pytest
from PIL import Image

from omlx.models.vlm_families import FAMILIES, hd_crop_rows


@pytest.mark.parametrize("num_crops", [4, 16])  # Phi-3.5-vision's: multi-frame, one image
@pytest.mark.parametrize("size", [(40, 50), (336, 336), (1000, 300), (90, 2000), (1344, 1008)])
def test_an_images_rows_are_those_mlx_vlms_phi3_v_processor_writes(
    num_crops: int, size: tuple[int, int]
) -> None:
    from mlx_vlm.models.phi3_v.processing_phi3_v import Phi3VImageProcessor

    processor = Phi3VImageProcessor(num_crops=num_crops)
    image = Image.new("RGB", size)
    image_size = processor([image])["image_sizes"][0].tolist()
    assert hd_crop_rows(image_size) == processor.calc_num_image_tokens(image)


def test_phi3_v_numbers_its_image_markers() -> None:
    entry = FAMILIES["phi3_v"]
    assert entry.numbered_images is hd_crop_rows
    assert entry.image_text is not None and entry.image_text.format(n=2) == "<|image_2|>"
