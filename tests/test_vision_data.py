"""Images in prompt rows (TRL's formats) and every bad row as one error naming row and column."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from grpokit.data.images import check_image_rows, image_column, row_images, with_image_placeholders
from grpokit.errors import DataError


def _png(tmp_path, name="a.png", color=(0, 128, 0)):
    path = tmp_path / name
    Image.new("RGB", (8, 6), color).save(path)
    return path


def test_every_image_form_loads(tmp_path):
    path = _png(tmp_path)
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), (1, 2, 3)).save(buffer, format="PNG")
    row = {"prompt": [{"role": "user", "content": "x"}],
           "images": [Image.new("L", (3, 3)), str(path), buffer.getvalue(), {"bytes": None, "path": str(path)}]}
    images = row_images(row, index=0)
    assert [im.mode for im in images] == ["RGB"] * 4 and images[1].size == (8, 6)
    assert images[2].getpixel((0, 0)) == (1, 2, 3)
    assert row_images({"prompt": "p", "image": "a.png"}, index=0, base=tmp_path)[0].size == (8, 6)  # relative path
    assert row_images({"prompt": "p", "image": None}, index=0) == []
    assert image_column([{"prompt": "p", "image": 1, "images": []}]) == "images"  # as TRL: images wins


def test_placeholders_are_inserted_before_the_first_user_text_as_trl_does():
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "q1"}, {"role": "user", "content": "q2"}]
    out = with_image_placeholders(prompt, 2, index=0)
    assert out[1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "q1"}]
    assert out[2]["content"] == [{"type": "text", "text": "q2"}] and prompt[1]["content"] == "q1"  # input untouched


@pytest.mark.parametrize("bad, words", [
    ("https://x.org/a.png", ["row 2", "'image'", "URL"]),
    ("missing.png", ["row 2", "'image'", "does not exist"]),
    (b"not an image", ["row 2", "'image'", "cannot be decoded"]),
    (3.5, ["row 2", "'image'", "float"]),
])
def test_unreadable_images_name_row_and_column(tmp_path, bad, words):
    rows = [{"prompt": [{"role": "user", "content": "a"}], "image": str(_png(tmp_path))},
            {"prompt": [{"role": "user", "content": "b"}], "image": bad}]
    with pytest.raises(DataError) as e:
        check_image_rows(rows, model_type="qwen2_vl", supported=True, has_vision=True, model_path="m", base=tmp_path)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_directory_and_an_image_over_pillows_pixel_limit_say_so(tmp_path, monkeypatch):
    """Issue 43 point 10: a directory "does not exist"; a 20000 x 20000 PNG "cannot be read as an image
    (DecompressionBombError); replace it with a PNG or JPEG". Pillow's limit is lowered here, not the image raised."""
    from PIL import Image as PILImage

    (tmp_path / "folder").mkdir()
    rows = [{"prompt": [{"role": "user", "content": "a"}], "image": str(tmp_path / "folder")}]
    with pytest.raises(DataError, match=r"row 1, column 'image': '.*folder' is a directory, not an image file"):
        check_image_rows(rows, model_type="qwen2_vl", supported=True, has_vision=True, model_path="m")
    path = _png(tmp_path, "big.png")  # 8 x 6 = 48 pixels
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 10)  # an error past twice the limit: 20
    for value, what in ((str(path), r"image file '.*big.png'"), (path.read_bytes(), "the image bytes")):
        rows = [{"prompt": [{"role": "user", "content": "a"}], "images": [value]}]
        with pytest.raises(DataError, match=rf"row 1, column 'images': {what} is over Pillow's pixel limit \(.*\); "
                                            "resize it to fewer pixels"):
            check_image_rows(rows, model_type="qwen2_vl", supported=True, has_vision=True, model_path="m")


def test_a_corrupt_file_is_named(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"garbage")
    rows = [{"prompt": [{"role": "user", "content": "a"}], "images": [str(tmp_path / "bad.png")]}]
    with pytest.raises(DataError, match="row 1, column 'images'.*bad.png.*cannot be read"):
        check_image_rows(rows, model_type="qwen2_vl", supported=True, has_vision=True, model_path="m")


def test_placeholders_and_images_must_agree(tmp_path):
    path = str(_png(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"},
                                                     {"type": "image"}]}], "images": [path]}]
    with pytest.raises(DataError, match="row 1: the prompt has 2 image placeholder.*'images' holds 1 image"):
        check_image_rows(rows, model_type="qwen2_vl", supported=True, has_vision=True, model_path="m")


def test_a_plain_string_prompt_with_images_is_refused(tmp_path):
    rows = [{"prompt": "what is this", "image": str(_png(tmp_path))}]
    with pytest.raises(DataError, match="row 1: rows with images need a conversational prompt"):
        check_image_rows(rows, model_type="qwen2_vl", supported=True, has_vision=True, model_path="m")


def test_images_with_a_text_only_model_name_the_model_type_and_the_fix(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "a"}], "image": str(_png(tmp_path))}]
    with pytest.raises(DataError) as e:
        check_image_rows(rows, model_type="qwen2", supported=False, has_vision=False, model_path="runs/tiny")
    assert all(w in str(e.value) for w in ("runs/tiny", "text-only", "'qwen2'", "--arch qwen2_vl", "'image'"))
    with pytest.raises(DataError, match="'llava'.*does not train yet"):
        check_image_rows(rows, model_type="llava", supported=False, has_vision=True, model_path="m")


def test_rows_without_images_are_text_rows(tmp_path):
    assert not check_image_rows([{"prompt": "a"}], model_type="qwen2", supported=False, has_vision=False,
                                model_path="m")
    assert not check_image_rows([{"prompt": "a", "images": []}], model_type="qwen2", supported=False,
                                has_vision=False, model_path="m")
