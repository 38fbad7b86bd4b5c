"""The memory a prompt's images take to encode (memory/vision.py), and the text dims
of nested VLM configs the guard prices (the dead-guard reason of seed 001)."""

from __future__ import annotations

from omlx.memory.dims import model_dims
from omlx.memory.vision import vision_dims, vision_transient_bytes

# A llava-1.5-7b config.json as HF ships it: the text numbers under text_config, the
# vision tower's (24 layers, 1024 wide) under vision_config.
LLAVA = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "text_config": {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "vision_config": {
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "image_size": 336,
        "patch_size": 14,
    },
}


def test_the_guard_reads_the_text_config_of_a_nested_vlm_config() -> None:
    dims = model_dims(LLAVA, kv_dtype_bytes=2)
    assert dims is not None
    assert (dims.num_layers, dims.hidden_size, dims.num_kv_heads) == (32, 4096, 32)


def test_image_transient_grows_with_images_and_their_size() -> None:
    dims = vision_dims(LLAVA, text_hidden_size=4096, dtype_bytes=2)
    assert (dims.hidden_size, dims.num_heads, dims.patch_size) == (1024, 16, 14)
    one = vision_transient_bytes(dims, (1, 3, 336, 336), 600)
    six = vision_transient_bytes(dims, (6, 3, 336, 336), 3500)
    small = vision_transient_bytes(dims, (1, 3, 224, 224), 300)
    assert small < one < six
    # 577 patches, 16 heads: the float32 scores alone are ~21 MB per image.
    assert one > 16 * 577 * 577 * 4
    assert six > 6 * 16 * 577 * 577 * 4


def test_no_pixels_no_transient() -> None:
    dims = vision_dims({}, text_hidden_size=64, dtype_bytes=4)
    assert vision_transient_bytes(dims, (), 10) == 0


def test_a_measured_image_pass_scales_the_formula_up_never_down() -> None:
    from omlx.memory.vision import measured_transient_bytes

    # Measured 2.5x the formula at the profile's image: every estimate 2.5x (ceiling).
    assert measured_transient_bytes(1000, 250, 100) == 2500
    assert measured_transient_bytes(3, 250, 100) == 8
    # A smaller reading (noise, an allocator that reused buffers) keeps the formula.
    assert measured_transient_bytes(1000, 50, 100) == 1000
    # Not measured (skipped, or a profile from before the image pass): the formula.
    assert measured_transient_bytes(1000, 0, 100) == 1000
    assert measured_transient_bytes(1000, 0, 0) == 1000


def test_qwen2_vl_flat_patches_are_priced_as_one_image_of_them_all() -> None:
    # Qwen2-VL: the tower is embed_dim wide (hidden_size is its merger's output) and
    # the processor hands over (patches, channels x 2 frames x 14 x 14).
    config = {"vision_config": {"embed_dim": 1280, "hidden_size": 1536, "num_heads": 16,
                                "patch_size": 14}}  # fmt: skip
    dims = vision_dims(config, text_hidden_size=1536, dtype_bytes=2)
    assert (dims.hidden_size, dims.num_heads) == (1536, 16)
    one = vision_transient_bytes(dims, (1024, 1176), 300)
    two = vision_transient_bytes(dims, (2048, 1176), 300)
    scores = 16 * 1024 * 1024 * 4  # heads x patches^2 in float32
    assert one > scores and two > 3 * scores  # quadratic in the patches


# Llama-3.2-11B-Vision's config.json (the fields the guard reads).
MLLAMA = {
    "model_type": "mllama",
    "text_config": {"hidden_size": 4096, "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38]},
    "vision_config": {"hidden_size": 1280, "intermediate_size": 5120, "num_attention_heads": 16,
                      "patch_size": 14, "image_size": 560, "max_num_tiles": 4},
}  # fmt: skip


def test_mllama_tiles_attend_as_one_image_and_its_states_are_priced() -> None:
    dims = vision_dims(MLLAMA, text_hidden_size=4096, dtype_bytes=2)
    assert dims.tiled_cross_attention
    # (batch, images, tiles, channels, height, width): the processor pads to 4 tiles.
    one = vision_transient_bytes(dims, (1, 1, 4, 3, 560, 560), 20)
    two = vision_transient_bytes(dims, (1, 2, 4, 3, 560, 560), 30)
    patches = 4 * (40 * 40 + 1)  # the tower attends over all 4 tiles' patches at once
    scores = 16 * patches * patches * 4
    states = patches * 4096 * 2  # kept for every decode step beside the prompt's KV
    assert one > scores + states
    assert two > 2 * (scores + states)
    # Counted as 4 separate tiles, the scores would be a quarter of that.
    per_tile = vision_dims({**MLLAMA, "text_config": {}}, text_hidden_size=4096, dtype_bytes=2)
    assert vision_transient_bytes(per_tile, (1, 1, 4, 3, 560, 560), 20) < scores


def test_molmo2_crops_of_flat_patches_are_priced_as_images() -> None:
    # Molmo2 as HF ships it: the tower's numbers at the root as vit_config; the
    # processor hands over (crops, 729 patches, 14 x 14 x 3 pixels).
    config = {"vit_config": {"hidden_size": 1152, "intermediate_size": 4304,
                             "num_attention_heads": 16, "image_patch_size": 14}}  # fmt: skip
    dims = vision_dims(config, text_hidden_size=2560, dtype_bytes=2)
    assert (dims.hidden_size, dims.num_heads, dims.patch_size) == (1152, 16, 14)
    two = vision_transient_bytes(dims, (2, 729, 588), 450)
    nine = vision_transient_bytes(dims, (9, 729, 588), 450)
    scores = 16 * 729 * 729 * 4  # a crop's heads x patches^2 in float32
    assert two > 2 * scores and nine > 9 * scores
    assert nine - two > 7 * (scores + 729 * (6 * 1152 + 4304) * 2)  # each crop's share


SIGLIP_LIKE = {"hidden_size": 1152, "intermediate_size": 4304, "num_attention_heads": 16,
               "patch_size": 14}  # fmt: skip


def test_moondream_channels_last_crops_are_priced_by_their_pixels() -> None:
    # Moondream's processor hands over (crops, 378, 378, 3): a crop of 27 x 27 patches.
    dims = vision_dims({"vision_config": SIGLIP_LIKE}, text_hidden_size=2048, dtype_bytes=2)
    last = vision_transient_bytes(dims, (2, 378, 378, 3), 770)
    first = vision_transient_bytes(dims, (2, 3, 378, 378), 770)
    assert last == first


def test_the_towers_width_under_molmo_and_step3p7_names() -> None:
    # Molmo: hidden_size is its projector's (18944), the tower is image_emb_dim wide;
    # Step-3.7's perception encoder names its width, heads and MLP ratio so.
    molmo = {"vision_config": {"hidden_size": 18944, "image_emb_dim": 1024,
                               "image_num_heads": 16, "image_mlp_dim": 4096}}  # fmt: skip
    step = {"vision_config": {"width": 1536, "heads": 16, "mlp_ratio": 8960 / 1536}}
    dims = vision_dims(molmo, text_hidden_size=3584, dtype_bytes=2)
    assert (dims.hidden_size, dims.num_heads, dims.intermediate_size) == (1024, 16, 4096)
    dims = vision_dims(step, text_hidden_size=4096, dtype_bytes=2)
    assert (dims.hidden_size, dims.num_heads, dims.intermediate_size) == (1536, 16, 8960)


def test_slices_encoded_apart_are_priced_each_at_its_own_size() -> None:
    import numpy as np

    from omlx.memory.vision import encode_transient_bytes, pixel_shapes

    # MiniCPM-V's processor: a list of slices a prompt, each its patches in one row
    # (3, 14, patches x 14): a 32x32-patch thumbnail and two 16x16-patch slices.
    dims = vision_dims(LLAVA, text_hidden_size=4096, dtype_bytes=2)
    pixels = [[np.zeros((3, 14, 14 * n), np.float32) for n in (1024, 256, 256)]]
    shapes = pixel_shapes(pixels)
    assert shapes == ((1, 3, 14, 14 * 1024), (1, 3, 14, 14 * 256), (1, 3, 14, 14 * 256))
    assert pixel_shapes(np.zeros((2, 3, 28, 28))) == ((2, 3, 28, 28),)
    whole = encode_transient_bytes(dims, shapes, 600)
    each = [vision_transient_bytes(dims, s, 600) for s in shapes]
    # The tower's part of each slice (its own patches' scores), the embeddings once.
    assert whole == sum(each) - 2 * 600 * 4096 * 2
    assert whole > 16 * (1025**2 + 2 * 257**2) * 4
    assert whole < vision_transient_bytes(dims, (3, 3, 14, 14 * 1024), 600)
