"""What a vision-language run shows of its images: completions.jsonl names each answer's images (a hash of the
pixels, the path where the data gave a file; never the pixels), the run folder keeps one thumbnail per image,
and the HTML report puts the thumbnails beside the sampled answers."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re

import pytest
from PIL import Image

from conftest import make_config
from grpokit import train
from grpokit.data.images import image_refs
from grpokit.models.tiny_vision import build_tiny_vlm
from grpokit.observe.report import build_report, group_table

COLORS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220)}


def by_hand(image: Image.Image) -> str:
    width, height = image.size
    return hashlib.sha256(f"{width}x{height}:".encode() + image.convert("RGB").tobytes()).hexdigest()[:16]


def test_image_refs_name_images_by_their_pixels_and_keep_the_data_path():
    red, also_red, blue = (Image.new("RGB", (8, 4), COLORS[c]) for c in ("red", "red", "blue"))
    # 8x4 red: the hash is over "8x4:" and 32 pixels of (220, 20, 20)
    assert image_refs({"image": red}, [red])[0].sha256 == hashlib.sha256(
        b"8x4:" + bytes([220, 20, 20]) * 32).hexdigest()[:16]
    assert image_refs({"image": red}, [red])[0].sha256 == image_refs({"image": also_red}, [also_red])[0].sha256
    assert image_refs({"image": red}, [red])[0].sha256 != image_refs({"image": blue}, [blue])[0].sha256
    tall = Image.new("RGB", (4, 8), COLORS["red"])  # the same bytes in another shape is another image
    assert image_refs({"image": tall}, [tall])[0].sha256 != image_refs({"image": red}, [red])[0].sha256
    refs = image_refs({"images": ["img/a.png", {"bytes": b"..", "path": "b.png"}, red]}, [red, blue, red])
    assert [r.record() for r in refs] == [{"sha256": by_hand(red), "path": "img/a.png"},
                                          {"sha256": by_hand(blue), "path": "b.png"}, {"sha256": by_hand(red)}]
    assert image_refs({"image": None}, []) == ()


def _rows():
    names = list(COLORS)
    return [{"prompt": [{"role": "user", "content": "colour?"}], "image": Image.new("RGB", (32, 32), COLORS[c]),
             "answer": c} for c in (names[i % 3] for i in range(4))]


def distinct_letters(completions, **kwargs):
    return [float(len(set(c[-1]["content"]))) for c in completions]


@pytest.mark.parametrize("arch", ["qwen2_vl", "idefics3", "gemma3"])
def test_completions_name_the_images_and_the_report_shows_their_thumbnails(tmp_path, arch):
    build_tiny_vlm(tmp_path / "vlm", arch=arch, hidden_size=32, num_layers=1, seed=1)
    config = make_config(tmp_path / "vlm", tmp_path / "run", steps=2, prompts_per_step=2, max_new_tokens=4,
                         output={"completions_every": 1})
    rows = _rows()
    run = train(config, rows=rows, reward_functions=[distinct_letters])
    lines = (run / "completions.jsonl").read_text().splitlines()
    completions = [json.loads(line) for line in lines]
    assert len(completions) == 2 * 2 * 4 and all(len(line) < 2000 for line in lines)  # names, not pixels
    expected = {by_hand(r["image"]): r["image"] for r in rows}
    for row in completions:
        assert len(row["images"]) == 1 and set(row["images"][0]) == {"sha256"}  # PIL images: no path
        assert row["images"][0]["sha256"] in expected
    seen = {row["images"][0]["sha256"] for row in completions}
    thumbs = {p.stem: p for p in (run / "images").iterdir()}
    assert set(thumbs) == seen  # one thumbnail per image named, no more
    for sha, path in thumbs.items():
        with Image.open(path) as thumb:  # a 32x32 image is its own thumbnail
            assert thumb.convert("RGB").tobytes() == expected[sha].tobytes()

    page = build_report(run).read_text()
    shown = re.findall(r'<img class="thumb" alt="image ([0-9a-f]{16})" title="[^"]*" '
                       r'src="data:image/png;base64,([^"]+)"', page)
    assert shown and {sha for sha, _ in shown} <= seen
    for sha, data in shown:
        assert base64.b64decode(data) == thumbs[sha].read_bytes()
    assert page.count('<div class="beside">') == len(shown)  # each group's table beside its image


def test_thumbnails_are_scaled_down_and_file_paths_are_recorded(tmp_path):
    from grpokit.observe.tracking import THUMBNAIL_PIXELS, save_thumbnails

    big = Image.new("RGB", (400, 200), COLORS["green"])
    Image.Image.save(big, tmp_path / "big.png")
    refs = image_refs({"images": ["big.png"]}, [big])
    save_thumbnails(tmp_path, refs)
    with Image.open(tmp_path / "images" / f"{refs[0].sha256}.png") as thumb:
        assert thumb.size == (THUMBNAIL_PIXELS, THUMBNAIL_PIXELS // 2)
    assert refs[0].record() == {"sha256": by_hand(big), "path": "big.png"}


def test_report_leaves_out_damaged_image_records_and_names_missing_thumbnails(tmp_path):
    png = io.BytesIO()
    Image.new("RGB", (4, 4), COLORS["blue"]).save(png, format="PNG")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "00112233aabbccdd.png").write_bytes(png.getvalue())
    (tmp_path / "secret.png").write_bytes(png.getvalue())
    group = [{"prompt": "p", "completion": "1", "reward": 1.0, "advantage": 0.5,
              "images": [{"sha256": "00112233aabbccdd", "path": "img/<a>.png"}, {"sha256": "ffffffffffffffff"},
                         {"sha256": "../secret"}, "not a record", {"path": "x.png"}]},
             {"prompt": "p", "completion": "2", "reward": 0.0, "advantage": -0.5}]
    html = group_table(group, images_dir=tmp_path / "images")
    assert html.count('<img class="thumb"') == 1 and "img/&lt;a&gt;.png" in html  # the path escaped in the title
    assert "image ffffffffffffffff<br>(no thumbnail)" in html
    assert "secret" not in html and "x.png" not in html
    assert group_table([{**group[0], "images": "bad"}], images_dir=tmp_path / "images").count("thumb") == 0
    assert "beside" not in group_table(group[1:], images_dir=tmp_path / "images")  # a text row: no images column
