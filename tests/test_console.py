"""The console: the libraries' expected warnings dropped, their errors of a failed save sent to a
file, and the cause of a nested TensorStore error in a few words."""

import _thread
import logging
import subprocess
import sys
import threading

from absl import logging as absl_logging

from vitmm import console


def _record(pathname: str, message: str, level=logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("absl", level, pathname, 1, message, None, None)


def test_quiet_drops_only_the_expected_warnings():
    keep = console._Expected()
    assert not keep.filter(_record("/x/tensorflow_datasets/core/dataset_builder.py",
                                   "Using custom data configuration: ScenesConfig(name='easy_32')"))
    assert not keep.filter(_record("/x/tensorflow_datasets/core/features/image_feature.py",
                                   "OpenCV is not installed. We recommend using OpenCV"))
    assert keep.filter(_record("/x/tensorflow_datasets/core/dataset_builder.py", "Something else went wrong"))
    assert keep.filter(_record("/x/vitmm/train/trainer.py", "Using custom data configuration"))  # not TFDS's
    assert keep.filter(_record("/x/orbax/checkpoint/manager.py", "read_only=True, setting", logging.ERROR))
    handler = absl_logging.get_absl_handler()
    try:
        console.quiet()
        console.quiet()
        assert handler.filters.count(console._EXPECTED) == 1
        console.quiet(verbose=True)
        assert console._EXPECTED not in handler.filters
    finally:
        console.quiet()


def test_library_errors_and_foreign_thread_writes_go_to_the_file(tmp_path, capsys):
    log = tmp_path / "errors.log"
    done = threading.Event()

    def foreign():  # a thread Python did not start, as TensorStore's are
        sys.stderr.write("Traceback (most recent call last):\nRuntimeError: Event loop is closed\n")
        done.set()

    orbax = logging.getLogger("absl")
    with console.library_errors_to(log):
        orbax.handle(_record("/x/orbax/checkpoint/future.py", "raised an exception: RESOURCE_EXHAUSTED", logging.ERROR))
        _thread.start_new_thread(foreign, ())
        assert done.wait(10)
        print("the run's own line", file=sys.stderr)
    written = log.read_text()
    assert "RESOURCE_EXHAUSTED" in written and "Event loop is closed" in written
    err = capsys.readouterr().err
    assert "the run's own line" in err and "Event loop" not in err and "RESOURCE_EXHAUSTED" not in err
    with console.library_errors_to(tmp_path / "quiet.log"):
        pass
    assert not (tmp_path / "quiet.log").exists()  # a good run leaves no empty errors.log


def test_cause_is_the_last_clause_of_a_nested_error():
    err = ValueError('RESOURCE_EXHAUSTED: Error writing "opt_state.1.0.count/0" in OCDBT database at local file '
                     '"/w/checkpoints/3.orbax-checkpoint-tmp/": Failed writing: "/w/d/3fd0": Failed to write 6615040 '
                     "bytes to file 9: No space left on device [os_error_code='28']")
    assert console.cause(err) == "No space left on device"
    assert console.cause(OSError(28, "No space left on device")) == "[Errno 28] No space left on device"
    assert console.cause(RuntimeError()) == "RuntimeError"
    assert console.cause(TypeError("'NoneType' object is not subscriptable")) == (
        "TypeError: 'NoneType' object is not subscriptable")  # not a nested status: the type says what broke


BUILD = """
import sys
from vitmm import console
console.quiet()
from vitmm.data import scenes_builder
scenes_builder.prepare("easy_32_8_8_8_s0", sys.argv[1])
"""


def test_a_first_scenes_build_says_generated_in_one_line(tmp_path):
    """TFDS printed "Downloading and preparing dataset", ~31 nested bars, "Using custom data
    configuration" and grain's OpenCV note for a build that downloads nothing."""
    result = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], capture_output=True, timeout=300)
    printed = (result.stdout + result.stderr).decode()  # bytes: text mode would turn a bar's \r into lines
    assert result.returncode == 0, printed[-3000:]
    bars = printed.count("example/s]")
    shown = [line.rsplit("\r", 1)[-1].strip() for line in printed.split("\n")]  # what a terminal leaves
    assert [line for line in shown if line] == [
        f"generated scenes/easy_32_8_8_8_s0 in {tmp_path}/scenes/easy_32_8_8_8_s0/1.0.0"], printed
    assert printed.count("generating scenes/easy_32_8_8_8_s0") == bars >= 1  # one bar, redrawn


def test_quiet_keeps_tfds_tensorflow_banner_off_stdout(capsys):
    """A dataset not prepared made TFDS probe TensorFlow, which printed a starred "Failed to import
    TensorFlow … Please install" block on stdout before vitmm's own error: TensorFlow is not a dependency."""
    import importlib.util

    import pytest
    from tensorflow_datasets.core.utils import lazy_imports_utils as utils

    if importlib.util.find_spec("tensorflow") is not None:
        pytest.skip("TensorFlow is installed here: TFDS prints no banner")
    try:
        console.quiet()
        with pytest.raises(ImportError):
            getattr(utils.tensorflow, "io")  # noqa: B009 - what TFDS's file utilities reach for
        assert capsys.readouterr().out == ""
        console.quiet(verbose=True)
        with pytest.raises(ImportError):
            getattr(utils.tensorflow, "io")  # noqa: B009
        assert "Failed to import TensorFlow" in capsys.readouterr().out
    finally:
        console.quiet()
