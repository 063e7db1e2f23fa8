"""Raw data as researchers have it: each reader on files the tests write (scenes as JPEG, PNG and
WebP in LLaVA folders, tar shards, CSV/TSV and parquet), images as PIL would give them, every bad
case skipped and named, and exact resume on shards and a mixture."""

import io
import json
import pickle
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from vitmm.data import (
    device_feed,
    examples,
    file_io,
    format_tables,
    format_wds,
    formats,
    ops_text,
    pipeline,
    preprocess,
    scenes,
    skips,
)
from vitmm.data.__main__ import main as data_main
from vitmm.data.images import decode_image, pad_to_square


def _png(image) -> bytes:
    return examples.encode(np.asarray(image), "png")


# ----------------------------------------------------------------------------------------------
#                                            Readers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("jsonl", [False, True])
def test_llava_reader_gives_each_conversation_with_its_image_bytes_and_text_only_ones(tmp_path, jsonl):
    path = examples.write_llava(tmp_path, 10, resolution=32, exts=("png", "jpg", "webp"), text_only_every=5,
                                jsonl=jsonl)
    source = formats.LlavaSource(path, tmp_path)
    assert len(source) == 10
    ex = source[0]
    assert ex["_id"] == "000000" and len(ex["images"]) == 1
    np.testing.assert_array_equal(decode_image(ex["images"][0]), scenes.generate("easy", 32, 0)["image"])  # PNG
    assert ex["conversations"][0] == {"from": "human", "value": "<image>\nDescribe the image."}
    text_only = source[4]
    assert text_only["images"] == [] and text_only["_id"] == "text000004"
    webp = decode_image(source[2]["images"][0]).astype(int)  # lossy formats: close to the scene
    assert np.abs(webp - scenes.generate("easy", 32, 2)["image"]).mean() < 6


def test_wds_reader_reads_img2dataset_shards_through_a_brace_pattern(tmp_path):
    pattern = examples.write_wds(tmp_path, 25, per_shard=10, resolution=32, exts=("png",))
    assert pattern.endswith("{00000..00002}.tar")
    source = formats.WdsSource(pattern)
    assert len(source) == 25
    ex = source[13]  # the 4th of the second shard
    assert ex["_id"] == "00001.tar/000010013"
    assert ex["caption"] == scenes.generate("easy", 32, 13)["caption"]
    np.testing.assert_array_equal(decode_image(ex["image"]), scenes.generate("easy", 32, 13)["image"])
    assert pickle.loads(pickle.dumps(source))[13]["image"] == ex["image"]  # for worker processes
    with pytest.raises(FileNotFoundError, match=r"input.wds=.*: 1 of 4 files do not exist \(first: .*00003.tar\)"):
        formats.WdsSource(pattern.replace("00002", "00003"))


def test_a_damaged_header_loses_its_stretch_only_and_joined_tars_read_whole(tmp_path, monkeypatch):
    """tarfile stops quietly at a damaged header: the reader goes on at the next whole one and
    counts what it could not read; tar files joined end to end read as one; a glob of a ``::``
    pattern that matches nothing is an error, not a source dropped; handles stay few."""
    pattern = examples.write_wds(tmp_path / "s", 30, per_shard=10, resolution=16)
    shards = formats.WdsSource(pattern).shards
    first = bytearray(shards[0].read_bytes())
    with tarfile.open(shards[0]) as tar:
        member = tar.getmembers()[9]  # a header in the middle of the shard
    first[member.offset + 10] ^= 0xFF
    shards[0].write_bytes(bytes(first) + shards[1].read_bytes())  # damaged, and another shard joined to it
    source = formats.WdsSource(str(shards[0]))
    reasons = [source[i].reason for i in range(len(source)) if isinstance(source[i], skips.Skipped)]
    good = [source[i] for i in range(len(source)) if not isinstance(source[i], skips.Skipped)]
    assert len(good) == 19 and sorted(reasons) == ["image_missing", "shard_unreadable"]  # 20 examples, one damaged
    with pytest.raises(FileNotFoundError, match=r"'.*/nope\*.tar' matches no file"):
        formats.WdsSource(f"{shards[2]}::{tmp_path}/s/nope*.tar")
    with tarfile.open(tmp_path / "pax.tar", "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "git"}) as tar:
        for name, data in (("k.png", _png(np.zeros((4, 4, 3), np.uint8))), ("k.txt", b"a square")):
            info = tarfile.TarInfo(name)  # a pax global header first, as `git archive` writes: no damage
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert formats.WdsSource(str(tmp_path / "pax.tar"))[0]["caption"] == "a square"
    many = formats.WdsSource(examples.write_wds(tmp_path / "many", 12, per_shard=1, resolution=16))
    monkeypatch.setattr(file_io, "HANDLES_PER_THREAD", 8)  # (a 64th of the open-file limit)
    assert len({many[i]["_id"] for i in range(12)}) == 12 and len(many._local.handles) == 8  # of 12 shards read


def test_wds_caption_falls_back_to_the_json_and_keys_follow_webdataset(tmp_path):
    with tarfile.open(tmp_path / "a.tar", "w") as tar:
        for name, data in (("dir/x.y.png", _png(np.zeros((4, 4, 3), np.uint8))),
                           ("dir/x.y.json", b'{"caption": "a black square"}')):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ex = formats.WdsSource(str(tmp_path / "a.tar"))[0]
    assert ex["_id"] == "a.tar/dir/x" and ex["caption"] == "a black square"
    with tarfile.open(tmp_path / "b.tar", "w") as tar:  # a key.json that is JSON but no object: a bad record
        for name, data in (("k.png", _png(np.zeros((4, 4, 3), np.uint8))), ("k.json", b'["a caption"]')):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert formats.WdsSource(str(tmp_path / "b.tar"))[0].reason == "bad_record"
    assert format_wds.split_key("dir/x.y.PNG") == ("dir/x", "y.png")


def test_wds_takes_the_exact_field_before_a_multi_dot_one(tmp_path, write_tar):
    """``key.jpg`` is the image and ``key.txt`` the caption even where ``key.depth.jpg`` and
    ``key.ocr.txt`` come first in the tar (as sorted members do); where every file of a key has several
    dots, several multi-dot candidates and no exact field are a ``bad_record`` naming them, as is a
    caption that is not UTF-8."""
    black, white = _png(np.zeros((4, 4, 3), np.uint8)), _png(np.full((4, 4, 3), 255, np.uint8))
    ex = formats.WdsSource(write_tar(tmp_path / "a.tar", [("0.depth.jpg", black), ("0.jpg", white),
                                                          ("0.ocr.txt", b"ocr"), ("0.txt", b"a white square")]))[0]
    assert decode_image(ex["image"]).min() == 255 and ex["caption"] == "a white square"
    bad = formats.WdsSource(write_tar(tmp_path / "b.tar", [("0.depth.jpg", black), ("0.seg.png", white),
                                                           ("0.cap.txt", b"a square")]))[0]
    assert bad.reason == "bad_record" and "key.depth.jpg, key.seg.png" in bad.detail
    latin1 = formats.WdsSource(write_tar(tmp_path / "c.tar", [("0.jpg", white),
                                                              ("0.txt", "un café".encode("latin-1"))]))
    assert latin1[0].reason == "bad_record" and "key.txt is not UTF-8 text (byte 6)" in latin1[0].detail


def test_wds_repeated_keys_are_separate_examples_with_their_own_ids(tmp_path, write_tar):
    """webdataset's grouping: a key seen again later in a shard (tars joined end to end), or a field
    that the current example already has, starts a new example; each keeps its own id."""
    square = _png(np.zeros((4, 4, 3), np.uint8))
    parts = [write_tar(tmp_path / f"{n}.tar", [("s0.jpg", square), ("s0.txt", f"{n} s0".encode()), ("s1.jpg", square),
                                          ("s1.txt", f"{n} s1".encode())]) for n in ("a", "b")]
    joined = tmp_path / "joined.tar"
    joined.write_bytes(b"".join(open(part, "rb").read() for part in parts))  # `cat a.tar b.tar`
    write_tar(tmp_path / "again.tar", [("k.jpg", square), ("k.txt", b"one"), ("k.jpg", square), ("k.txt", b"two")])
    source = formats.WdsSource(f"{joined}::{tmp_path}/again.tar")
    read = [source[i] for i in range(len(source))]
    assert [ex["caption"] for ex in read] == ["a s0", "a s1", "b s0", "b s1", "one", "two"]
    assert [ex["_id"] for ex in read] == ["joined.tar/s0", "joined.tar/s1", "joined.tar/s0#2", "joined.tar/s1#2",
                                          "again.tar/k", "again.tar/k#2"]


@pytest.mark.parametrize("separator", [",", "\t"])
def test_csv_reader_reads_open_clip_columns(tmp_path, separator):
    path = examples.write_csv(tmp_path, 6, resolution=32, separator=separator)
    source = formats.CsvSource(path)
    assert len(source) == 6 and source[3]["caption"] == scenes.generate("easy", 32, 3)["caption"]
    assert source[3]["_id"] == f"{path.name}:5"
    with pytest.raises(ValueError, match=r"no column\(s\) \['url'\].*set input.csv_img_key"):
        formats.CsvSource(path, img_key="url")


def test_a_csv_in_another_separator_says_to_set_csv_separator(tmp_path):
    """open_clip's default separator is a tab, in files named .csv: the error names the separator to
    set, not the column keys; a header with none of them keeps the column advice."""
    (tmp_path / "tabs.csv").write_text("filepath\ttitle\na.png\ta cat\n")
    with pytest.raises(ValueError, match=r"looks '\\t'-separated; set input.csv_separator='\\t'\.$"):
        formats.CsvSource(tmp_path / "tabs.csv")
    (tmp_path / "semi.csv").write_text("filepath;title\na.png;a cat\n")
    with pytest.raises(ValueError, match=r"looks ';'-separated; set input.csv_separator=';'"):
        formats.CsvSource(tmp_path / "semi.csv")
    (tmp_path / "one.csv").write_text("path\na.png\n")
    with pytest.raises(ValueError, match=r"no column\(s\) \['filepath', 'title'\].*set input.csv_img_key"):
        formats.CsvSource(tmp_path / "one.csv")


def test_csv_and_jsonl_as_editors_write_them(tmp_path):
    """Excel's byte-order mark, a quoted caption over two lines, a row without its image path (skipped
    and named, not a crash); JSONL whose text holds U+2028 (a line separator to splitlines only)."""
    image = examples.encode(scenes.generate("easy", 16, 0)["image"], "png")
    (tmp_path / "a.png").write_bytes(image)
    (tmp_path / "data.csv").write_text('\ufefffilepath,title\na.png,"two\nlines"\n,no image\na.png,last\n',
                                       encoding="utf-8")
    source = formats.CsvSource(tmp_path / "data.csv")
    assert [source[i].get("caption") for i in (0, 2)] == ["two\nlines", "last"]
    assert source[1] == skips.Skipped("image_missing", "data.csv:4", "the row has no image path")
    assert source[2]["_id"] == "data.csv:5"  # the line it starts on, after the two-line caption
    (tmp_path / "blank.csv").write_text("filepath,title\n\na.png,after a blank line\n", encoding="utf-8")
    assert formats.CsvSource(tmp_path / "blank.csv")[0]["_id"] == "blank.csv:3"
    (tmp_path / "latin.csv").write_bytes("filepath,title\na.png,caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.csv is not UTF-8 text"):
        formats.CsvSource(tmp_path / "latin.csv")
    record = {"id": "x", "image": "a.png", "conversations": [{"from": "human", "value": "<image>\nwhat\u2028is it?"},
                                                            {"from": "gpt", "value": "a\u2029b"}]}
    (tmp_path / "data.jsonl").write_text("\ufeff" + json.dumps(record, ensure_ascii=False) + "\n", encoding="utf-8")
    llava = formats.LlavaSource(str(tmp_path / "data.jsonl"), str(tmp_path))
    assert len(llava) == 1 and llava[0]["conversations"][1]["value"] == "a\u2029b"


def test_files_that_cannot_be_read_as_the_format_are_named_in_one_line(tmp_path):
    """One indented JSON object is not JSONL; a LLaVA-NeXT YAML that does not parse; a later parquet
    file without the columns, or not parquet at all; a weighted mixture entry with no examples."""
    (tmp_path / "one.json").write_text(json.dumps({"data": [{"id": 1}]}, indent=2))
    with pytest.raises(ValueError, match=r"one.json holds one JSON object \(keys \['data'\]\), not a list"):
        formats.LlavaSource(tmp_path / "one.json")
    (tmp_path / "bad.yaml").write_text("datasets:\n  - json_path: [unclosed\n")
    with pytest.raises(ValueError, match=r"bad.yaml' is not a readable YAML file \("):
        formats.source_from({"data_path": str(tmp_path / "bad.yaml")}, 0)
    first = examples.write_parquet(tmp_path / "p1", 4, resolution=16)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [b"x"], "text": ["a"]}), tmp_path / "p2.parquet")
    with pytest.raises(ValueError, match=r"p2.parquet has columns \['image', 'text'\]; set input.parquet_image_key"):
        formats.ParquetSource(f"{first}::{tmp_path / 'p2.parquet'}")
    (tmp_path / "p3.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"input.parquet: .*p3.parquet cannot be read as parquet"):
        formats.ParquetSource(f"{first}::{tmp_path / 'p3.parquet'}")
    llava = examples.write_llava(tmp_path / "l", 4, resolution=16)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match=r"input.mixture entry 1 has no examples"):
        formats.source_from({"mixture": [{"data_path": str(llava), "weight": 1},
                                         {"data_path": str(tmp_path / "empty.json"), "weight": 1}]}, 0)


def test_data_that_is_all_bad_stops_instead_of_reading_forever(broken_llava, tmp_path, monkeypatch):
    """A wrong image folder makes every example bad: the batch never fills, so the share is judged
    while it fills, and (several processes, whose own limit is off) a long run of bad ones stops."""
    (tmp_path / "elsewhere").mkdir()
    source = formats.LlavaSource(broken_llava, tmp_path / "elsewhere")  # every image missing
    with pytest.raises(skips.TooManySkipped, match=r"Too much bad data: read 14, skipped 14 \(100.00%\)"):  # one epoch
        next(pipeline.train_iterator(source, preprocess.parse(LLAVA_PP), 4, seed=0, num_threads=1, skip_bad=0.01))
    monkeypatch.setattr(skips, "ALL_BAD", 50)
    with pytest.raises(skips.TooManySkipped, match=r"50 examples in a row were bad"):
        next(pipeline.train_iterator(source, preprocess.parse(LLAVA_PP), 4, seed=0, num_threads=1,
                                     skip_bad=skips.local_limit(0.01, 2)))


def test_parquet_row_groups_too_large_to_read_at_random_are_named(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = format_tables.LARGE_GROUP + 1
    pq.write_table(pa.table({"image": [b"x"] * rows, "caption": ["c"] * rows}), tmp_path / "big.parquet",
                   row_group_size=rows)
    source = formats.ParquetSource(str(tmp_path / "big.parquet"))
    assert source[rows - 1]["caption"] == "c"  # read a row at a time from the Arrow column
    assert f"big.parquet and the rest hold row groups of up to {rows:,} rows" in capsys.readouterr().out


def test_parquet_reader_reads_hf_image_structs_and_chat_messages(tmp_path):
    path = examples.write_parquet(tmp_path / "caps", 7, resolution=32, row_group_size=3)
    source = formats.ParquetSource(str(path))
    assert len(source) == 7 and source.image_key == "image" and source.text_key == "caption"
    assert source[5]["caption"] == scenes.generate("easy", 32, 5)["caption"]  # the second row group
    assert abs(decode_image(source[5]["image"]).astype(int) - scenes.generate("easy", 32, 5)["image"]).mean() < 6
    chat = formats.ParquetSource(str(examples.write_parquet(tmp_path / "chat", 3, resolution=32, messages=True)))
    ex = chat[1]
    assert len(ex["images"]) == 1
    scene = scenes.generate("easy", 32, 1)
    assert ex["conversations"] == [{"from": "user", "value": "<image>\n" + scene["questions"][0]},
                                   {"from": "assistant", "value": scene["answers"][0]}]
    assert pickle.loads(pickle.dumps(source))[5]["caption"] == source[5]["caption"]  # for worker processes
    assert format_tables.as_conversations([{"user": "q", "assistant": "a", "source": "x"}]) == [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]  # the_cauldron's texts
    # with its images: at the start of the first user turn, as the_cauldron means them, so the row trains
    cauldron = format_tables.as_conversations([{"user": "q", "assistant": "a", "source": "x"}], num_images=2)
    assert cauldron[0] == {"from": "human", "value": "<image><image>\nq"}
    tokens = ops_text.conversation_tokens(64)({"conversations": cauldron, "num_images": 2}, None)
    assert int(tokens["answer_mask"].sum()) > 0


def test_parquet_image_paths_are_read_and_other_cells_are_bad_records(tmp_path):
    """A string cell is a path, as the struct's ``path`` (relative to the parquet's folder); a cell
    of another type is a counted ``bad_record`` naming the column and the type, not a crash."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs/a.png").write_bytes(_png(np.full((4, 4, 3), 7, np.uint8)))
    pq.write_table(pa.table({"image": ["imgs/a.png", "imgs/nope.png"], "caption": ["a", "b"]}), tmp_path / "p.parquet")
    source = formats.ParquetSource(str(tmp_path / "p.parquet"))
    assert decode_image(source[0]["image"]).max() == 7 and source[1].reason == "image_missing"
    pq.write_table(pa.table({"image": [3], "caption": ["a"]}), tmp_path / "ints.parquet")
    bad = formats.ParquetSource(str(tmp_path / "ints.parquet"))[0]
    assert bad.reason == "bad_record" and "column 'image' holds int" in bad.detail


def test_mixture_sampling_rules_and_weights_are_deterministic(tmp_path):
    a = examples.write_llava(tmp_path / "a", 10, resolution=16)
    b = examples.write_llava(tmp_path / "b", 6, resolution=16, text_only_every=1)  # ids text000000, ...
    assert formats.subsample(10, "first:3").tolist() == [0, 1, 2]
    assert formats.subsample(10, "end:2").tolist() == [8, 9]
    assert formats.subsample(10, "random:50%").tolist() == formats.subsample(10, "random:5").tolist()
    assert len(formats.subsample(10, "random:5%")) == len(formats.subsample(10, "first:1%")) == 1  # rounded up
    with pytest.raises(ValueError, match="sampling='some'"):
        formats.subsample(10, "some")
    concat = formats.source_from({"mixture": [dict(data_path=str(a), sampling="first:4"),
                                              dict(data_path=str(b), sampling="end:2")]})
    assert [concat[i]["_id"] for i in range(len(concat))] == ["000000", "000001", "000002", "000003",
                                                              "text000004", "text000005"]
    mixture = {"mixture": [dict(data_path=str(a), weight=3.0), dict(data_path=str(b), weight=1.0)]}
    ids = [formats.source_from(mixture)[i]["_id"] for i in range(40)]
    assert ids == [formats.source_from(mixture)[i]["_id"] for i in range(40)]  # rebuilt: the same stream
    assert sum(i.startswith("text") for i in ids) == 10  # one in four from the second source
    assert sum(i.startswith("text") for i in ids[:20]) == 5  # in every stretch, not just overall
    # Each pass reads every example of every source (grain's mix read 5 of these 100 each pass, and no more).
    big, small = list(range(100)), [1000 + i for i in range(5)]
    mixed = formats.Mixed([big, small], [1.0, 1.0])
    seen = [mixed[i] for i in range(len(mixed))]
    assert len(mixed) == 199 and set(seen) == set(big) | set(small) and seen[:4] == [0, 1000, 1, 1001]
    three = formats.Mixed([list(range(7)), list(range(100, 1000)), ["x"] * 3], [1.0, 2.0, 0.5])
    seen = [three[i] for i in range(len(three))]
    assert set(range(7)) | set(range(100, 1000)) <= set(seen)
    assert abs(sum(isinstance(x, int) and x >= 100 for x in seen) / len(seen) - 2 / 3.5) < 0.01
    with pytest.raises(ValueError, match="give every entry a positive weight, or none"):
        formats.source_from({"mixture": [dict(data_path=str(a), weight=1.0), dict(data_path=str(b))]})
    with pytest.raises(ValueError, match="set only one of"):
        formats.source_from({"data_path": str(a), "wds": "x.tar"})


# ----------------------------------------------------------------------------------------------
#                                            Images
# ----------------------------------------------------------------------------------------------
def test_images_decode_as_pil_converts_them_with_exif_orientation_applied():
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (6, 10, 3), dtype=np.uint8)
    assert decode_image(_png(rgb)).tobytes() == rgb.tobytes()
    grey = rgb[..., 0]
    np.testing.assert_array_equal(decode_image(_png(grey)), np.repeat(grey[..., None], 3, -1))
    rgba = np.concatenate([rgb, rng.integers(0, 256, (6, 10, 1), dtype=np.uint8)], -1)
    np.testing.assert_array_equal(decode_image(_png(rgba)), rgb)  # alpha dropped, as convert("RGB")
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, "JPEG", quality=100)
    cmyk = buf.getvalue()
    np.testing.assert_array_equal(decode_image(cmyk), np.asarray(Image.open(io.BytesIO(cmyk)).convert("RGB")))
    # EXIF orientation 6: the stored pixels are turned 90 degrees clockwise for display.
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, "PNG", exif=exif.tobytes())
    assert decode_image(buf.getvalue()).shape == (10, 6, 3)
    np.testing.assert_array_equal(decode_image(buf.getvalue()), np.rot90(rgb, -1))
    sixteen = io.BytesIO()
    Image.fromarray(np.arange(12, dtype=np.uint16).reshape(3, 4) * 4000).save(sixteen, "PNG")
    got = decode_image(sixteen.getvalue())[..., 0]
    np.testing.assert_array_equal(got.ravel(), np.round(np.arange(12) * 4000 / 257))  # scaled, not clipped to white
    dark = io.BytesIO()
    Image.fromarray(np.full((2, 2), 1000, np.uint16)).save(dark, "PNG")
    assert (decode_image(dark.getvalue()) == 4).all()  # dark stays dark: one mapping, not each image's own maximum
    with pytest.raises(skips.BadExample, match="image_unreadable"):
        decode_image(b"not an image")
    with pytest.raises(skips.BadExample, match="image_unreadable"):
        decode_image(examples.encode(rgb, "jpg")[:200])  # a truncated JPEG


def test_pad_to_square_matches_llavas_expand2square():
    image = np.random.default_rng(1).integers(0, 256, (5, 9, 3), dtype=np.uint8)
    fill = tuple(int(x * 255) for x in (0.48145466, 0.4578275, 0.40821073))
    pil = Image.fromarray(image)
    reference = Image.new("RGB", (9, 9), fill)  # LLaVA's expand2square, written with PIL
    reference.paste(pil, (0, (9 - 5) // 2))
    np.testing.assert_array_equal(pad_to_square(image, fill), np.asarray(reference))
    op = preprocess.parse("pad_to_square((0.48145466, 0.4578275, 0.40821073))")
    np.testing.assert_array_equal(op({"image": image.transpose(1, 0, 2)}, None)["image"],
                                  np.asarray(reference).transpose(1, 0, 2))


# ----------------------------------------------------------------------------------------------
#                                           Bad data
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def broken_llava(tmp_path):
    """A LLaVA folder with one example of every bad kind after 8 good ones."""
    path = examples.write_llava(tmp_path, 8, resolution=16)
    records = json.loads(path.read_text())
    (tmp_path / "images/corrupt.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    good_image = records[0]["image"]
    records += [
        {"id": "missing", "image": "images/nope.jpg", "conversations": records[0]["conversations"]},
        {"id": "corrupt", "image": "images/corrupt.jpg", "conversations": records[0]["conversations"]},
        {"id": "empty", "image": good_image, "conversations": []},
        {"id": "twice", "image": good_image, "conversations": [{"from": "human", "value": "<image>\nq"},
                                                               {"from": "human", "value": "q"}]},
        {"id": "no_tag", "image": good_image, "conversations": [{"from": "human", "value": "q"},
                                                                {"from": "gpt", "value": "a"}]},
        {"id": "robot", "conversations": [{"from": "robot", "value": "q"}, {"from": "gpt", "value": "a"}]},
    ]
    path.write_text(json.dumps(records))
    return path


BAD = {"missing": "image_missing", "corrupt": "image_unreadable", "empty": "empty_conversation",
       "twice": "turns_not_alternating", "no_tag": "image_tag_mismatch", "robot": "unknown_role"}


def test_check_names_every_bad_example_by_id_and_reason(broken_llava, tmp_path, capsys):
    assert data_main(["check", "--data_path", str(broken_llava), "--image_folder", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    for example_id, reason in BAD.items():
        assert f"bad: {example_id}: {reason}" in out
    assert out.strip().splitlines()[-1].startswith("8 good, 6 bad (empty_conversation 1, image_missing 1")
    good = examples.write_llava(tmp_path / "ok", 3, resolution=16)
    assert data_main(["check", "--data_path", str(good)]) == 0
    assert data_main(["check", "--data_path", str(tmp_path / "none.json")]) == 2


def test_check_names_a_truncated_shard_bad_jsonl_lines_and_missing_captions(tmp_path, capsys):
    pattern = examples.write_wds(tmp_path / "wds", 6, per_shard=6, resolution=16)
    shard = tmp_path / "wds/00000.tar"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 10240 - 700])  # the end-of-archive blocks and part of the last member
    assert data_main(["check", "--wds", pattern]) == 1
    out = capsys.readouterr().out
    assert "shard_truncated" in out and out.strip().endswith("of 6.")
    jsonl = examples.write_llava(tmp_path / "j", 3, resolution=16, jsonl=True)
    jsonl.write_text(jsonl.read_text() + "{not json\n")
    csv_path = examples.write_csv(tmp_path / "c", 3, resolution=16)
    csv_path.write_text(csv_path.read_text() + "images/000000.jpg,\n")
    assert data_main(["check", "--data_path", str(jsonl)]) == 1
    assert data_main(["check", "--csv", str(csv_path)]) == 1
    out = capsys.readouterr().out
    assert "bad: data.jsonl:line4: bad_record" in out and "bad: data.csv:5: caption_missing" in out


LLAVA_PP = ("decode|pad_to_square()|resize(16)|value_range(-1, 1)|conversation_tokens(160)|"
            "keep('image', 'ids', 'answer_mask', 'prompt_len', 'image_pos', 'has_image')")


def test_training_skips_and_counts_bad_examples_then_stops_past_the_limit(broken_llava, tmp_path):
    source = formats.LlavaSource(broken_llava, tmp_path)
    pp = preprocess.parse(LLAVA_PP)
    it = pipeline.train_iterator(source, pp, 4, seed=0, num_threads=1, skip_bad=1.0)
    batches = [next(it) for _ in range(6)]
    assert all(b["ids"].shape == (4, 160) and "_id" not in b for b in batches)
    counts = it.get_state()["counts"]
    assert counts["read"] >= 24 and sum(counts["skipped"].values()) == counts["read"] - 24
    # 24 good examples are three epochs of 8 good and 6 bad: every bad one seen two or three times.
    assert set(counts["skipped"]) == set(BAD.values()) and set(counts["skipped"].values()) <= {2, 3}
    assert counts["read"] <= 3 * 14 and counts["first"]["image_missing"] == ["missing"]
    metrics = skips.metrics(it.get_state())
    assert metrics["data/skipped"] == sum(counts["skipped"].values())
    strict = pipeline.train_iterator(source, pp, 4, seed=0, num_threads=1, skip_bad=0.01)
    with pytest.raises(skips.TooManySkipped, match=r"Too much bad data: read \d+, skipped \d+ \(\d+\.\d\d%\): .*"
                                                   r"image_missing \d \(e.g. missing\).*python -m vitmm.data check"):
        for _ in range(4):
            next(strict)


def test_several_processes_stop_together_on_their_summed_counts():
    """With several processes no process's own iterator stops the run (the others would wait in the
    step's collectives); the summed counts every process logs decide for all at the same step."""
    assert skips.local_limit(0.01, 1) == 0.01 and skips.local_limit(0.01, 2) == 1.0
    assert skips.local_limit(None, 2) is None  # data that skips nothing
    summed = {"data/read": 2000.0, "data/skipped": 20.0, "data/skipped/image_missing": 20.0}
    skips.check_all_processes(summed, 0.01, 2)  # 1.00%: at the limit, not past it
    skips.check_all_processes({**summed, "data/read": 900.0}, 0.01, 2)  # too few read to judge
    with pytest.raises(skips.TooManySkipped, match=r"over the 2 processes: read 2000, skipped 21 \(1.05%\): "
                                                   r"image_missing 21, more than input.max_skipped_share=0.01"):
        skips.check_all_processes({**summed, "data/skipped": 21.0, "data/skipped/image_missing": 21.0}, 0.01, 2)


def test_evaluation_masks_bad_records_out(broken_llava, tmp_path):
    source = formats.LlavaSource(broken_llava, tmp_path)
    batches = list(pipeline.eval_batches(source, preprocess.parse(LLAVA_PP), 5, process_index=0, process_count=1,
                                         num_threads=1))
    mask = np.concatenate([b["_mask"] for b in batches])
    assert mask.tolist() == [1] * 8 + [0] * 6 + [0]  # 8 good, 6 bad, 1 padding


# ----------------------------------------------------------------------------------------------
#                                        Sharding and resume
# ----------------------------------------------------------------------------------------------
def _ids(batch):
    return batch["caption_tokens"][:, :12].tolist()


def _resumes_exactly(source, pp, batch=4, seen=3, more=4):
    full = pipeline.train_iterator(source, pp, batch, seed=3, num_threads=2, prefetch=6, skip_bad=0.5)
    reference = [_ids(next(full)) for _ in range(seen + more)]
    first = pipeline.train_iterator(source, pp, batch, seed=3, num_threads=2, prefetch=6, skip_bad=0.5)
    for _ in range(seen):
        next(first)
    state = json.loads(json.dumps(first.get_state()))  # as a checkpoint stores it
    resumed = pipeline.train_iterator(source, pp, batch, seed=3, num_threads=2, prefetch=6, skip_bad=0.5)
    resumed.set_state(state)
    assert [_ids(next(resumed)) for _ in range(more)] == reference[seen:]
    assert resumed.get_state()["counts"] == full.get_state()["counts"]


CLIP_PP = "decode|random_resized_crop(16)|value_range(-1, 1)|tokenize('caption', 32)|keep('image', 'caption_tokens')"


def test_shards_resume_exactly_with_a_truncated_shard_counted(tmp_path):
    pattern = examples.write_wds(tmp_path, 20, per_shard=7, resolution=16)
    last = tmp_path / "00002.tar"
    last.write_bytes(last.read_bytes()[:-10240 - 600])
    source = formats.WdsSource(pattern)
    _resumes_exactly(source, preprocess.parse(CLIP_PP))


@pytest.mark.parametrize("into_header, listed, whole", [(300, 3, 2), (20, 3, 2), (5, 2, 1)])
def test_a_shard_cut_inside_a_header_keeps_the_examples_before_it(tmp_path, into_header, listed, whole):
    """Cut inside the third example's first header after its name (``000000002.jpg`` and a NUL):
    the two before it are read and the third is counted; cut inside the name, it may be another file
    of the second example, so the second is counted instead."""
    pattern = examples.write_wds(tmp_path, 3, per_shard=3, resolution=16)
    shard = tmp_path / "00000.tar"
    with tarfile.open(shard) as tar:
        members = tar.getmembers()
    keys = list(dict.fromkeys(format_wds.split_key(m.name)[0] for m in members))
    third = next(m for m in members if format_wds.split_key(m.name)[0] == keys[2])
    shard.write_bytes(shard.read_bytes()[:third.offset + into_header])
    source = formats.WdsSource(pattern)
    assert len(source) == listed
    read = [source[i] for i in range(listed)]
    assert sum(not isinstance(r, skips.Skipped) for r in read) == whole
    assert all(r.reason == "shard_truncated" for r in read if isinstance(r, skips.Skipped))


def test_a_weighted_mixture_resumes_exactly(tmp_path):
    csv_source = dict(csv=str(examples.write_csv(tmp_path / "c", 9, resolution=16)), weight=1.0)
    pq_source = dict(parquet=str(examples.write_parquet(tmp_path / "p", 8, resolution=16, row_group_size=3)),
                     weight=2.0)
    _resumes_exactly(formats.source_from({"mixture": [csv_source, pq_source]}), preprocess.parse(CLIP_PP))


def test_processes_read_disjoint_examples(tmp_path):
    source = formats.CsvSource(examples.write_csv(tmp_path, 12, resolution=16))
    pp = preprocess.parse("decode|tokenize('caption', 64)|keep('caption_tokens')")
    seen = []
    for index in range(2):
        it = pipeline.train_iterator(source, pp, 4, seed=0, process_index=index, process_count=2, num_threads=1,
                                     skip_bad=0.0, num_epochs=1)
        seen.append({tuple(row) for _ in range(3) for row in next(it)["caption_tokens"].tolist()})
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) == 12


def test_processes_shuffle_and_augment_with_their_own_draws(tmp_path):
    """Each host's seed is its own: the same positions hold neither the same augmentation draws nor
    records 2j and 2j+1 together in every epoch (process 0 keeps the run's seed)."""
    source = formats.CsvSource(examples.write_csv(tmp_path, 16, resolution=16))

    def pp(ex, rng):
        return {"draw": np.int64(rng.integers(1 << 30)), "row": np.int64(int(ex["_id"].rsplit(":", 1)[-1]))}

    runs = [next(pipeline.train_iterator(source, pp, 8, seed=0, process_index=i, process_count=2, num_threads=1,
                                         skip_bad=0.0, num_epochs=1)) for i in range(2)]
    assert not set(runs[0]["draw"].tolist()) & set(runs[1]["draw"].tolist())
    assert [r // 2 for r in runs[0]["row"].tolist()] != [r // 2 for r in runs[1]["row"].tolist()]
    assert pipeline.process_seed(3, 0) == 3 and len({pipeline.process_seed(3, i) for i in range(4)}) == 4


def test_examples_command_writes_each_format(tmp_path):
    for fmt in examples.FORMATS:
        out = subprocess.run([sys.executable, "-m", "vitmm.data", "examples", "--format", fmt, "--out",
                              str(tmp_path / fmt), "--num", "3", "--resolution", "16"],
                             capture_output=True, text=True, check=True).stdout
        assert out.startswith(f"wrote 3 {fmt} examples: ")


def test_the_llava_pipeline_reads_hf_chat_parquet(tmp_path):
    source = formats.ParquetSource(str(examples.write_parquet(tmp_path, 6, resolution=16, messages=True)))
    it = pipeline.train_iterator(source, preprocess.parse(LLAVA_PP), 3, seed=0, num_threads=1, skip_bad=0.0)
    batch = next(it)
    assert batch["has_image"].all() and batch["image"].shape == (3, 16, 16, 3)
    assert (batch["answer_mask"].sum(1) > 1).all() and it.get_state()["counts"]["read"] == 3


def test_a_llava_next_yaml_concatenates_its_files_with_their_sampling_rules(tmp_path):
    examples.write_llava(tmp_path / "a", 10, resolution=16)
    examples.write_llava(tmp_path / "b", 6, resolution=16, text_only_every=1)
    (tmp_path / "mix.yaml").write_text("datasets:\n  - json_path: a/data.json\n    sampling_strategy: end:3\n"
                                       "  - json_path: b/data.json\n")
    source = formats.source_from({"data_path": str(tmp_path / "mix.yaml"), "image_folder": str(tmp_path / "a")})
    assert [source[i]["_id"] for i in range(len(source))] == ["000007", "000008", "000009"] + [
        f"text{i:06d}" for i in range(6)]
    (tmp_path / "bad.yaml").write_text("datasets: [a.json]\n")
    with pytest.raises(ValueError, match="a list of entries with json_path"):
        formats.source_from({"data_path": str(tmp_path / "bad.yaml")})
    # A weight on every entry interleaves them in those proportions (input.mixture's, from a command line).
    (tmp_path / "weighted.yaml").write_text("datasets:\n  - json_path: a/data.json\n    weight: 1\n"
                                            "  - json_path: b/data.json\n    weight: 3\n")
    mixed = formats.source_from({"data_path": str(tmp_path / "weighted.yaml"), "image_folder": str(tmp_path / "a")})
    first = [mixed[i]["_id"].startswith("text") for i in range(400)]
    assert isinstance(mixed, formats.Mixed) and sum(first) == 300


def test_each_process_gets_its_own_iterator_state_back():
    states = [{"examples": {"next_index": 7}, "counts": {"read": 7}}, {"examples": {"next_index": 9}, "counts": {}}]
    mine = 0

    def allgather(x):  # what process_allgather returns on process `mine` of two: every process's array, stacked
        x = np.asarray(x)
        other = np.frombuffer(json.dumps(states[1]).encode(), np.uint8) if x.ndim else np.int32(
            len(json.dumps(states[1]).encode()))
        if x.ndim:
            width = max(len(x), len(other))
            x, other = np.pad(x, (0, width - len(x))), np.pad(other, (0, width - len(other)))
        return np.stack([x, other])

    saved = device_feed.gather_states(states[mine], allgather)
    saved = json.loads(json.dumps(saved))  # through the checkpoint's JSON
    assert [device_feed.own_state(saved, i, 2) for i in range(2)] == states
    assert device_feed.own_state({"next_index": 3}, 0, 1) == {"next_index": 3}  # one process's, saved bare before
    with pytest.raises(ValueError, match="saved by 1 process; this run has 2. Resume with 1 process "):  # its slice
        device_feed.own_state({"next_index": 3}, 1, 2)
    with pytest.raises(ValueError, match="saved by 2 processes; this run has 4. Resume with 2 processes"):
        device_feed.own_state(saved, 0, 4)
