"""Video for the VLM: frames sampled from a video file (PyAV) or a list of frame images.

    frames = decode_video(open("clip.mp4", "rb").read(), num_frames=8)   # 8 × uint8 [H, W, 3]

The sampling rule: of a video's ``n`` frames, the ``k`` at ``np.linspace(0, n - 1, k)`` rounded
down (the first and the last frame always, evenly between). For ``n >= k`` that is lmms-eval's
``read_video_pyav`` and LLaVA-Video's ``load_video`` with ``force_sample=True`` (without it,
LLaVA-Video takes one frame a second when that gives at most ``k``). A video shorter than ``k``
frames repeats some, so every video gives the model ``k`` frames (fixed image slots, and pairs for
``temporal_patch(2)``), where lmms-eval takes its ``n`` frames once. A stream's rotation (phone
videos) is not applied. A list of frame images is sampled the same way.
The ``decode`` op puts the frames where ``<video>`` stood (or the one ``<image>`` of a record
without ``<video>``, LLaVA-NeXT's tag) as ``k`` consecutive images (one ``<image>`` each), so they
reach the LM as ``k`` frames of visual tokens; ``temporal_patch(2)``
then merges each two into one image of twice the channels (Qwen2-VL's temporal patch: the tower's
patch embedding sees two frames at once, and the LM gets half the tokens). Both are here; the
preprocessing registry (``data.preprocess``) calls them.
"""

from __future__ import annotations

import io

import numpy as np

from vitmm.data.skips import BadExample

VIDEO_PLACEHOLDER = "<video>"
IMAGE_PLACEHOLDER = "<image>"


def check_count(name: str, value) -> None:
    """A ``ValueError`` in one line unless ``value`` is a whole number of frames, at least 1."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}={value!r}: a number of frames, at least 1.")


def sample_indices(total: int, num_frames: int) -> np.ndarray:
    """The frame indices ``num_frames`` samples take of a ``total``-frame video (see above)."""
    if total < 1:
        raise BadExample("image_unreadable", "the video has no frames")
    return np.linspace(0, total - 1, num_frames).astype(np.int64)


def decode_video(data: bytes, num_frames: int) -> list[np.ndarray]:
    """``num_frames`` RGB uint8 frames of an encoded video (any container and codec FFmpeg reads),
    decoded once in order, keeping only the sampled ones."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise BadExample("image_unreadable", "the file has no video stream (audio only?)")
            stream = container.streams.video[0]
            total = stream.frames
            if not total:  # a container that does not say: count by decoding
                total = sum(1 for _ in container.decode(video=0))
                container.seek(0)
            wanted = sample_indices(total, num_frames)
            kept = {}
            for index, frame in enumerate(container.decode(video=0)):
                if index in wanted:
                    kept[index] = frame.to_ndarray(format="rgb24")
                if index >= wanted[-1]:
                    break
    except (av.FFmpegError, IndexError, ValueError) as err:
        raise BadExample("image_unreadable", f"the video cannot be decoded ({err})") from None
    if int(wanted[-1]) not in kept:  # the header counted frames the stream does not hold
        raise BadExample("image_unreadable", f"the video ended before frame {int(wanted[-1])} of {total}")
    return [kept[int(i)] for i in wanted]


def sample_frames(frames: list, num_frames: int) -> list:
    """``num_frames`` of a list of frames (images, encoded or not) by the same rule."""
    return [frames[int(i)] for i in sample_indices(len(frames), num_frames)]


def video_as_images(ex: dict, video, images, num_frames: int, decode_image, image_key: str = "image") -> None:
    """The frames of ``video`` (a file's bytes, or a list of frames that ``decode_image`` makes
    RGB) as the example's images in ``image`` and ``more_images``, its ``<video>`` tag expanded
    to one ``<image>`` a frame (the ``decode`` op's video path). A conversation with no ``<video>``
    and exactly one ``<image>`` has the video there: LLaVA-NeXT's trainer marks a video's place
    with ``DEFAULT_IMAGE_TOKEN``, and video data is written with either tag."""

    def text(turn):
        return turn.get("value", turn.get("content")) if isinstance(turn, dict) else None

    turns = ex.get("conversations") or []
    texts = [t for t in map(text, turns) if isinstance(t, str)]
    tags, image_tags = (sum(t.count(tag) for t in texts) for tag in (VIDEO_PLACEHOLDER, IMAGE_PLACEHOLDER))
    place = IMAGE_PLACEHOLDER if tags == 0 and image_tags == 1 else VIDEO_PLACEHOLDER
    if images or (tags != 1 and place == VIDEO_PLACEHOLDER):
        raise BadExample("image_tag_mismatch", f"{tags} {VIDEO_PLACEHOLDER} tag(s) for one video"
                         + (" and images (a video goes alone)" if images else
                            f" (and {image_tags} {IMAGE_PLACEHOLDER}: a video's place is one {VIDEO_PLACEHOLDER}, "
                            f"or one {IMAGE_PLACEHOLDER} in a record without {VIDEO_PLACEHOLDER})" if image_tags
                            else ""))
    frames = decode_video(video, num_frames) if isinstance(video, bytes) else \
        [decode_image(frame) for frame in sample_frames(list(video), num_frames)]
    expanded = IMAGE_PLACEHOLDER * len(frames)
    ex["conversations"] = [
        {k: v.replace(place, expanded) if k in ("value", "content") and isinstance(v, str) else v
         for k, v in turn.items()} for turn in turns]
    ex[image_key], ex["num_images"], ex["has_image"] = frames[0], np.int32(len(frames)), np.bool_(True)
    ex["more_images"], ex["video_frames"] = frames[1:], np.int32(len(frames))


def temporal_patch(size=2, key="image"):
    """Qwen2-VL's temporal patch: a video's frames (``decode``'s, ``video_frames`` of them) merged
    ``size`` at a time into one image of ``size`` × the channels (the last group padded with its
    last frame; its ``<image>`` tags cut to one a group), and a still image repeated ``size`` times
    the same way, so the tower's patch embedding sees ``size`` frames at once. Put it after the
    image ops (``normalize`` included) and before ``conversation_tokens``."""
    check_count("temporal_patch size", size)

    def fn(ex, rng):
        images = [ex[key], *ex.get("more_images", [])]
        frames = int(ex.get("video_frames", 0))
        if frames:
            groups = [images[i:i + size] for i in range(0, frames, size)]
            merged = [np.concatenate(g + [g[-1]] * (size - len(g)), axis=-1) for g in groups]
            tags = ("<image>" * frames, "<image>" * len(merged))
            ex["conversations"] = [{k: v.replace(*tags) if k in ("value", "content") and isinstance(v, str) else v
                                    for k, v in turn.items()} for turn in ex["conversations"]]
            ex["video_frames"], ex["num_images"] = np.int32(len(merged)), np.int32(len(merged))
        else:
            merged = [np.concatenate([image] * size, axis=-1) for image in images]
        ex[key] = merged[0]
        if len(merged) > 1 or "more_images" in ex:
            ex["more_images"] = merged[1:]
        return ex

    return fn
