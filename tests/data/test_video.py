"""Video (``data.video``): frames sampled by LLaVA-Video's rule from an MPEG-4 file PyAV writes
and from a list of frame files, placed where ``<video>`` stood, merged two at a time by
``temporal_patch``; a stage-2 run trains on videos packed with images."""

import json

import numpy as np
import pytest

from vitmm.chat import main as chat_main
from vitmm.config_args import load
from vitmm.data import examples, formats, preprocess, video
from vitmm.data.skips import BadExample
from vitmm.train import trainer


def _bars(n: int) -> list[np.ndarray]:
    """Frame ``i``: a white bar at columns ``4i … 4i + 3`` of a black 32×48 frame."""
    frames = []
    for i in range(n):
        frame = np.zeros((32, 48, 3), np.uint8)
        frame[:, 4 * i: 4 * i + 4] = 255
        frames.append(frame)
    return frames


def _which(frame: np.ndarray) -> int:
    return int(np.argmax(frame[..., 0].mean(0).reshape(-1, 4).mean(1)))


def test_frames_are_sampled_by_llava_videos_rule_from_a_file(tmp_path):
    path = examples.write_video(tmp_path / "bars.mp4", _bars(11))
    frames = video.decode_video(path.read_bytes(), 4)
    np.testing.assert_array_equal(video.sample_indices(11, 4), [0, 3, 6, 10])  # np.linspace(0, 10, 4) floored
    assert [_which(f) for f in frames] == [0, 3, 6, 10] and frames[0].shape == (32, 48, 3)
    assert [_which(f) for f in video.decode_video(path.read_bytes(), 16)][:3] == [0, 0, 1]  # a short video repeats
    with pytest.raises(BadExample, match="image_unreadable"):
        video.decode_video(b"not a video", 4)


def test_a_container_without_a_frame_count_is_counted_by_decoding():
    """Matroska/WebM headers hold no frame count (``stream.frames`` is 0): the frames are counted by
    decoding, then the file is read again from its start, by the same rule."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as container:
        stream = container.add_stream("mpeg4", rate=4)
        stream.height, stream.width, stream.pix_fmt = 32, 48, "yuv420p"
        for frame in _bars(11):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    with av.open(io.BytesIO(buf.getvalue())) as container:
        assert container.streams.video[0].frames == 0
    assert [_which(f) for f in video.decode_video(buf.getvalue(), 4)] == [0, 3, 6, 10]


def test_a_file_without_a_video_stream_says_so():
    """An audio file FFmpeg reads is refused as having no video stream, not ``tuple index out of range``."""
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    with pytest.raises(BadExample, match=r"^image_unreadable: the file has no video stream \(audio only\?\)$"):
        video.decode_video(buf.getvalue(), 4)


def test_a_video_becomes_frames_where_its_tag_stood_and_temporal_patches_halve_them(tmp_path):
    (tmp_path / "f").mkdir()
    names = []
    for i, frame in enumerate(_bars(6)):
        names.append(f"f/{i}.png")
        (tmp_path / names[-1]).write_bytes(examples.encode(frame, "png"))
    examples.write_video(tmp_path / "v.mp4", _bars(6))
    conv = [{"from": "human", "value": "Watch: <video>\nWhat moves?"}, {"from": "gpt", "value": "a bar"}]
    (tmp_path / "d.json").write_text(json.dumps([{"id": "a", "video": "v.mp4", "conversations": conv},
                                                 {"id": "b", "video": names, "conversations": conv}]))
    source = formats.LlavaSource(tmp_path / "d.json")
    pp = preprocess.parse("decode(max_images=1, num_frames=3)|resize(16)")
    for record in (source[0], source[1]):
        ex = pp(record, None)
        assert ex["num_images"] == 3 and ex["video_frames"] == 3 and len(ex["more_images"]) == 2
        assert ex["conversations"][0]["value"] == "Watch: <image><image><image>\nWhat moves?"
        assert ex["image"].shape == ex["more_images"][1].shape == (16, 16, 3)  # every frame through the ops
    merged = preprocess.parse("decode(num_frames=3)|resize(16)|temporal_patch(2)")(source[1], None)
    assert merged["num_images"] == 2 and merged["image"].shape == (16, 16, 6) and len(merged["more_images"]) == 1
    np.testing.assert_array_equal(merged["more_images"][0][..., :3], merged["more_images"][0][..., 3:])  # padded
    assert merged["conversations"][0]["value"] == "Watch: <image><image>\nWhat moves?"
    still = preprocess.parse("decode|temporal_patch(2)")({"image": _bars(1)[0]}, None)
    np.testing.assert_array_equal(still["image"], np.concatenate([_bars(1)[0]] * 2, -1))
    with pytest.raises(BadExample, match="2 <video> tag"):
        pp({**source[0], "conversations": [{**conv[0], "value": "<video><video>"}, conv[1]]}, None)
    with pytest.raises(BadExample, match="a <video> tag but no video"):
        pp({"images": [], "conversations": conv}, None)


def test_llava_next_frame_folders_and_image_tags_are_read_as_videos(tmp_path):
    """LLaVA-NeXT's video layout: ``video`` a folder of frames (its image files sorted by name, other
    files left out) and the video's place its one ``<image>`` tag when there is no ``<video>``."""
    (tmp_path / "clips/c1").mkdir(parents=True)
    for i, frame in enumerate(_bars(6)):
        (tmp_path / f"clips/c1/frame_{i:02d}.png").write_bytes(examples.encode(frame, "png"))
    (tmp_path / "clips/c1/notes.txt").write_text("not a frame")
    (tmp_path / "clips/empty").mkdir()
    conv = [{"from": "human", "value": "<image>\nWhat moves?"}, {"from": "gpt", "value": "a bar"}]
    (tmp_path / "d.json").write_text(json.dumps([{"id": "a", "video": "clips/c1", "conversations": conv},
                                                 {"id": "b", "video": "clips/empty", "conversations": conv}]))
    source = formats.LlavaSource(tmp_path / "d.json")
    assert len(source[0]["video"]) == 6 and source[1].reason == "image_missing"
    ex = preprocess.parse("decode(num_frames=3)")(source[0], None)
    assert [_which(f) for f in [ex["image"], *ex["more_images"]]] == [0, 2, 5] and ex["video_frames"] == 3
    assert ex["conversations"][0]["value"] == "<image><image><image>\nWhat moves?"
    with pytest.raises(BadExample, match=r"0 <video> tag\(s\) for one video \(and 2 <image>"):
        preprocess.parse("decode(num_frames=3)")(
            {**source[0], "conversations": [{**conv[0], "value": "<image><image>"}, conv[1]]}, None)


def test_a_configs_pp_keeps_a_videos_frame_count_for_mrope(tmp_path):
    """The LLaVA configs' ``keep(...)`` names no ``video_frames``; it stays with ``more_images``, so
    M-RoPE (``model.mrope``) places the video's 2 temporal patches at ``(p + τ, p + i, p + j)``, not
    as two images one after the other."""
    from vitmm.data import sequences
    from vitmm.train import pp_template

    path = examples.write_llava(tmp_path / "d", 2, resolution=32, video_every=2)
    config = load("configs/llava_finetune.py", "smoke,pack=600,frames=4,temporal=2",
                  **{"input.data_path": str(path), "model.mrope": True})
    ex = preprocess.parse(pp_template.pp_string(config))(formats.LlavaSource(path)[1], np.random.default_rng(0))
    assert ex["video_frames"] == 2 and len(ex["more_images"]) == 1
    seq = sequences.to_sequence(ex, 4, mrope_grid=(2, 2))
    p = int(np.flatnonzero(seq["visual"] >= 0)[0])
    tau, i, j = np.repeat([0, 1], 4), np.tile([0, 0, 1, 1], 2), np.tile([0, 1], 4)
    np.testing.assert_array_equal(seq["mrope"][seq["visual"] >= 0].T, p + np.stack([tau, i, j]))


def test_chat_and_serve_take_a_video_from_a_run_with_frames_and_one_image_an_example():
    """``frames=8,temporal=2`` (``images=1``: one image an example) trains on videos, 4 image slots
    each, so its prompts take one; a run whose rows hold fewer slots than a video fills skipped
    every video in training and refuses one in a line."""
    from vitmm import chat

    def slots(arg):
        config = load("configs/llava_finetune.py", f"smoke,{arg}")
        return chat.video_slots(config, chat.served_pp(config))

    assert slots("pack=600,frames=8,temporal=2") == 4 and slots("pack=600,frames=5") == 5
    for arg in ("pack=600", "images=1"):  # 8 frames (decode's default) for 2 slots; no flat sequences
        with pytest.raises(ValueError, match=r"^This model takes no video \(a run on input.sequences with frames"):
            slots(arg)


def test_frame_counts_below_one_are_refused_in_one_line_before_any_example():
    """``frames=-3`` or ``temporal=0`` (a ZeroDivisionError before), and ``decode(num_frames=0)`` or
    ``temporal_patch(0)``, which skipped every video as unreadable or raised mid-run, and ``frames``
    with ``anyres`` (each frame's views overflowed its row: every video skipped): each a one-line
    ``ValueError`` naming the values, at config or pp construction."""
    with pytest.raises(ValueError, match=r"^frames=4 with anyres=16: a video's frames as AnyRes views are not supp"):
        load("configs/llava_finetune.py", "smoke,pack=600,frames=4,anyres=16")  # was: every video too long for a row
    for arg in ("frames=-3", "temporal=0", "frames=8,temporal=-1"):
        with pytest.raises(ValueError, match=r"^frames=-?\d+, temporal=-?\d+: frames is a video's frames \(0: no"):
            load("configs/llava_finetune.py", f"smoke,pack=600,{arg}")
    for spec, name in (("decode(num_frames=0)", "decode num_frames=0"),
                       ("decode(num_frames=-2)", "decode num_frames=-2"),
                       ("decode|temporal_patch(0)", "temporal_patch size=0")):
        with pytest.raises(ValueError, match=rf"^{name}: a number of frames, at least 1\.$"):
            preprocess.parse(spec)


def test_videos_and_images_train_packed_with_temporal_patches_from_an_inflated_tower(tmp_path, clip_smoke_run):
    """Stage 2 on LLaVA data with videos (8 frames, merged two at a time: 4 images of 6 channels)
    among single and multi-image conversations, the tower a 3-channel CLIP run whose patch kernel is
    inflated: a still image embeds as it did."""
    from vitmm import checkpoint as ckpt_lib
    from vitmm.models.vit import ViT
    from vitmm.train import pp_template

    path = examples.write_llava(tmp_path / "d", 12, resolution=32, text_only_every=5, multi_image_every=4,
                                video_every=3)
    config = load("configs/llava_finetune.py", "smoke,pack=600,images=3,frames=8,temporal=2",
                  **{"input.data_path": str(path), "init.vision": str(clip_smoke_run.workdir),
                     "init.allow_random_tower": False, "model.vision_layer": -1})
    summary = trainer.train(config, tmp_path / "run")
    assert np.isfinite(summary["history"][-1]["loss"])
    clip_video = str(tmp_path / "d/videos/000002.mp4")
    assert chat_main(["--workdir", str(tmp_path / "run"), "--video", clip_video, "--question", "What is last?",
                      "--max_new_tokens", "2"]) == 0
    assert chat_main(["--workdir", str(tmp_path / "run"), "--video", str(tmp_path / "d/data.json"),
                      "--question", "?"]) == 2

    import base64

    import openai

    from vitmm import serve

    engine = serve.Engine(tmp_path / "run")
    url, stop = serve.start_in_thread(engine)
    try:
        part = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,"
                                                          + base64.b64encode(open(clip_video, "rb").read()).decode()}}
        reply = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="run", max_tokens=3, temperature=0,
            messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is last?"}]}])
    finally:
        stop()
    example = engine.chat.prepare([], [{"from": "human", "value": "<video>\nWhat is last?"}],
                                  open(clip_video, "rb").read())
    eos = engine.chat.tokenizer.eos_id
    assert reply.choices[0].message.content == engine.chat.tokenizer.decode(
        [t for t in engine.chat.generate(example, 3) if t != eos])
    assert reply.usage.prompt_tokens == engine.chat.num_prompt_tokens(example)
    assert len(example["more_images"]) == 3  # 8 frames, merged two at a time
    kernel = ckpt_lib.load_params(tmp_path / "run")["tower"]["embedding"]["kernel"]
    clip = ckpt_lib.load_params(clip_smoke_run.workdir)["img"]
    assert kernel.shape[2] == 6 and pp_template.image_channels(config) == 6
    np.testing.assert_allclose(kernel, np.tile(clip["embedding"]["kernel"], (1, 1, 2, 1)) / 2, rtol=1e-6)
    image = np.random.default_rng(0).normal(size=(1, 32, 32, 3)).astype(np.float32)
    tower = ViT(**ckpt_lib.load_config(clip_smoke_run.workdir)["model"]["image"])
    params = {**clip, "embedding": {**clip["embedding"], "kernel": kernel}}
    np.testing.assert_allclose(tower.apply({"params": params}, np.concatenate([image] * 2, -1))[0],
                               tower.apply({"params": clip}, image)[0], rtol=1e-5, atol=1e-5)
