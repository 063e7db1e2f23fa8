"""Video for the VLM: frames sampled from a video file (PyAV) or a list of frame images.

    frames = decode_video(open("clip.mp4", "rb").read(), num_frames=8)   # 8 × uint8 [H, W, 3]

The sampling rule is LLaVA-Video's and lmms-eval's: of a video's ``n`` frames, the ``k`` at
``np.linspace(0, n - 1, k)`` rounded down (the first and the last frame always, evenly between; a
video shorter than ``k`` frames repeats some). A list of frame images is sampled the same way.
The ``decode`` op puts the frames where ``<video>`` stood as ``k`` consecutive images (one
``<image>`` each), so they reach the LM as ``k`` frames of visual tokens; ``temporal_patch(2)``
then merges each two into one image of twice the channels (Qwen2-VL's temporal patch: the tower's
patch embedding sees two frames at once, and the LM gets half the tokens).
"""

from __future__ import annotations

import io

import numpy as np

from vitmm.data.skips import BadExample

VIDEO_PLACEHOLDER = "<video>"


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
