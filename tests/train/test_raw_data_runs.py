"""The raw-data configs train end to end on files the tests write: LLaVA stage 1 and stage 2 on a
LLaVA folder (text-only and bad examples mixed in) resuming exactly, `vitmm.chat` on an image file,
and CLIP on tar shards evaluated on a CSV."""

import json
import multiprocessing

import numpy as np
import pytest

from vitmm import chat
from vitmm.config_args import load
from vitmm.data import examples
from vitmm.train import trainer


@pytest.fixture(scope="session")
def llava_folder(tmp_path_factory):
    """24 scenes conversations (every 6th text-only) and one whose image is missing."""
    root = tmp_path_factory.mktemp("llava")
    path = examples.write_llava(root, 24, resolution=32, exts=("jpg", "png", "webp"), text_only_every=6)
    records = json.loads(path.read_text())
    records.append({"id": "lost", "image": "images/lost.jpg", "conversations": records[0]["conversations"]})
    path.write_text(json.dumps(records))
    return root


def _llava(config: str, folder, **overrides):
    return load(f"configs/{config}.py", "smoke", **{"input.data_path": str(folder / "data.json"),
                                                    "input.image_folder": str(folder), "input.max_skipped_share": 0.2,
                                                    **overrides})


def test_llava_stages_train_resume_exactly_count_bad_examples_and_chat(tmp_path, llava_folder, capsys):
    held_out = {"evals.val.data.data_path": str(llava_folder / "data.json"), "evals.val.num_examples": 25}
    stage1 = trainer.train(_llava("llava_pretrain", llava_folder, log_every=1, **held_out), tmp_path / "s1")
    assert stage1["evals"]["val/examples"] == 24 and stage1["evals"]["val/skipped"] == 1  # the lost image
    assert np.isfinite(stage1["evals"]["val/loss"]) and 0 <= stage1["evals"]["val/token_acc"] <= 1
    rows = [json.loads(line) for line in (tmp_path / "s1/metrics.jsonl").read_text().splitlines()]
    rows = [row for row in rows if "loss" in row]  # the training rows (evaluations have their own)
    assert rows[-1]["data/read"] >= 16 and rows[-1]["data/read"] == 16 + rows[-1]["data/skipped"]
    assert rows[-1].get("data/skipped/image_missing", 0) == rows[-1]["data/skipped"]
    assert np.isfinite(stage1["history"][-1]["loss"])

    config = _llava("llava_finetune", llava_folder, **{"init.checkpoint": str(tmp_path / "s1")})
    stopped = trainer.train(config, tmp_path / "s2", stop_at=2)
    resumed = trainer.train(config, tmp_path / "s2")
    straight = trainer.train(config, tmp_path / "s2_straight")
    assert stopped["final_step"] == 2 and resumed["final_step"] == 4
    assert resumed["param_checksum"] == pytest.approx(straight["param_checksum"], rel=1e-6)
    np.testing.assert_allclose(resumed["history"][-1]["loss"], straight["history"][-1]["loss"], rtol=1e-6)

    assert "data: read" in capsys.readouterr().out  # the log named the skipped example
    image = str(llava_folder / "images/000000.jpg")
    assert chat.main(["--workdir", str(tmp_path / "s2"), "--image", image, "--question", "Describe it.",
                      "--max_new_tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"[{image}: 32x32]\nuser: Describe it.\nassistant: ")
    assert chat.main(["--workdir", str(tmp_path / "s2"), "--image", str(tmp_path / "none.jpg"),
                      "--question", "?"]) == 2
    with pytest.raises(ValueError, match=r"must be uint8 \[H, W, 3\].*got float64 \(4, 4\)"):
        chat.load(tmp_path / "s2").ask(np.zeros((4, 4)), "?")


def test_clip_trains_on_tar_shards_in_worker_processes_resumes_and_evaluates_on_a_csv(tmp_path):
    """Reading in 2 worker processes, stopped at step 2 and resumed, the run ends where an
    uninterrupted one ends."""
    pattern = examples.write_wds(tmp_path / "shards", 24, per_shard=10, resolution=32)
    val = examples.write_csv(tmp_path / "val", 16, resolution=32, split="validation")
    config = load("configs/clip_wds.py", "smoke", **{"input.wds": pattern, "evals.retrieval.data.csv": str(val),
                                                     "input.workers": 2})
    straight = trainer.train(config, tmp_path / "straight")
    assert trainer.train(config, tmp_path / "run", stop_at=2)["final_step"] == 2
    summary = trainer.train(config, tmp_path / "run")
    assert summary["final_step"] == 4 and not multiprocessing.active_children()
    assert summary["param_checksum"] == pytest.approx(straight["param_checksum"], rel=1e-6)
    evals = summary["evals"]
    assert 0 <= evals["retrieval/i2t_r1"] <= evals["retrieval/i2t_r5"] <= evals["retrieval/i2t_r10"] <= 1
    assert evals["retrieval/chance_r1"] < 0.2  # 16 held-out pairs, scored


def test_a_raw_data_config_without_its_data_stops_in_one_line_before_writing(tmp_path):
    with pytest.raises(ValueError, match="names no training data: set one of --config.input.data_path"):
        trainer.train(load("configs/llava_pretrain.py", "smoke"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def multi_image_run(tmp_path_factory):
    """LLaVA stage 2 on conversations of 1 to 3 images (some text-only, one with a missing image)
    packed into rows: an uninterrupted run, and one stopped at step 2 and resumed."""
    root = tmp_path_factory.mktemp("multi")
    path = examples.write_llava(root / "data", 20, resolution=32, text_only_every=5, multi_image_every=3)
    records = json.loads(path.read_text())
    records.append({"id": "lost", "image": ["images/000000.jpg", "images/lost.jpg"],
                    "conversations": records[2]["conversations"]})
    path.write_text(json.dumps(records))
    config = load("configs/llava_finetune.py", "smoke,pack=400,images=3",
                  **{"input.data_path": str(path), "input.max_skipped_share": 0.2,
                     "evals.val.data.data_path": str(path), "evals.val.num_examples": 21})
    straight = trainer.train(config, root / "straight")
    stopped = trainer.train(config, root / "run", stop_at=2)
    resumed = trainer.train(config, root / "run")
    return dict(root=root, straight=straight, stopped=stopped, resumed=resumed,
                images=[str(root / f"data/images/00000{i}.jpg") for i in (0, 1)])


def test_conversations_with_several_images_train_packed_and_resume_exactly(multi_image_run, capsys):
    """The held-out loss reads the packed run's examples one a row; a run stopped at step 2 and
    resumed ends where an uninterrupted one ends; `vitmm.chat` asks it about two images."""
    run = multi_image_run
    straight = run["straight"]
    assert straight["evals"]["val/examples"] == 20 and straight["evals"]["val/skipped"] == 1
    assert np.isfinite(straight["evals"]["val/loss"]) and np.isfinite(straight["history"][-1]["loss"])
    assert run["stopped"]["final_step"] == 2
    assert run["resumed"]["param_checksum"] == pytest.approx(straight["param_checksum"], rel=1e-6)

    images = run["images"]
    asked = ["--workdir", str(run["root"] / "run"), "--question", "Describe image 2.", "--max_new_tokens", "3"]
    assert chat.main([*asked, "--image", images[0], "--image", images[1]]) == 0
    assert capsys.readouterr().out.startswith(f"[{images[0]}: 32x32]\n[{images[1]}: 32x32]\nuser: Describe image 2.")
    assert chat.main([*asked, *(x for _ in range(4) for x in ("--image", images[0]))]) == 2
    assert "4 --image files; this model takes at most 3" in capsys.readouterr().err


def test_the_server_takes_several_images_and_answers_what_chat_answers(multi_image_run):
    import base64

    import openai

    from vitmm import serve
    from vitmm.data.images import decode_image

    engine = serve.Engine(multi_image_run["root"] / "run")
    url, stop = serve.start_in_thread(engine)
    images = multi_image_run["images"]
    try:
        parts = [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,"
                                                            + base64.b64encode(open(f, "rb").read()).decode()}}
                 for f in images]
        reply = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
            model="run", max_tokens=4, temperature=0,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "Describe image 2."}]}])
    finally:
        stop()
    decoded = [decode_image(open(f, "rb").read()) for f in images]
    assert reply.choices[0].message.content == engine.chat.ask(decoded, "Describe image 2.", 4)
    assert reply.usage.prompt_tokens == engine.chat.num_prompt_tokens(
        engine.chat.prepare(decoded, [{"from": "human", "value": "<image>\n<image>\nDescribe image 2."}]))


@pytest.mark.parametrize("sizes", ["native=16,connector=patch_merger", "anyres=16"])
def test_images_at_their_own_sizes_train_packed_and_chat(tmp_path, capsys, sizes):
    """``native=16`` with Qwen2-VL's patch merger (each image resized to fit 16 patches in 2×2
    windows, keeping its aspect, its patches packed NaViT-style for the tower) or ``anyres=16``
    (LLaVA-NeXT's views of each image in the slots): stage 2 trains, a held-out loss reads one
    example a row, and `vitmm.chat` answers about two images of other sizes."""
    from PIL import Image

    data = examples.write_llava(tmp_path / "data", 20, resolution=32, text_only_every=5, multi_image_every=3)
    config = load("configs/llava_finetune.py", f"smoke,pack=400,images=3,{sizes}",
                  **{"input.data_path": str(data), "input.max_skipped_share": 0.2,
                     "evals.val.data.data_path": str(data), "evals.val.num_examples": 21})
    summary = trainer.train(config, tmp_path / "run")
    assert np.isfinite(summary["history"][-1]["loss"]) and np.isfinite(summary["evals"]["val/loss"])
    assert summary["evals"]["val/examples"] == 20  # one a row, the tower's tokens packed as in training
    wide, tall = tmp_path / "wide.png", tmp_path / "tall.png"
    Image.fromarray(np.full((16, 48, 3), 200, np.uint8)).save(wide)
    Image.fromarray(np.full((40, 24, 3), 90, np.uint8)).save(tall)
    capsys.readouterr()
    assert chat.main(["--workdir", str(tmp_path / "run"), "--image", str(wide), "--image", str(tall),
                      "--question", "Which is wider?", "--max_new_tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith(f"[{wide}: 48x16]\n[{tall}: 24x40]\nuser: Which is wider?")
