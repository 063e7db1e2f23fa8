"""What a vitmm command prints: the run, not its libraries.

A healthy run made TFDS, grain and orbax print warnings a newcomer reads as problems: "Using custom
data configuration" for every scenes build, "OpenCV is not installed" (vitmm decodes with Pillow
on purpose), orbax's notes on every read-only checkpoint read and on the data-iterator item a
parameter-only restore leaves out. ``quiet()`` drops exactly those (``--verbose`` keeps them);
every other warning still prints. It also keeps off stdout the starred "Failed to import TensorFlow …
Please install" banner TFDS prints when a data folder is probed without TensorFlow (a dataset not
prepared): TensorFlow is not a dependency, and vitmm's own error says what to do.

A failed save or restore made orbax and TensorStore print hundreds of lines from their own threads
(an error per array, then an asyncio traceback per aborted write) before vitmm's one-line message.
``library_errors_to(path)`` sends those to a file (``WORKDIR/errors.log``) while it is active, and
``cause(err)`` gives the few words at the bottom of such an error for the one line.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import threading

# (a part of the emitting file's path, how the message starts): warnings every healthy run printed.
EXPECTED = (
    ("tensorflow_datasets", "Using custom data configuration"),  # every scenes config built by name
    ("tensorflow_datasets", "Variant folder"),  # "... has no dataset_info.json": a build not written yet
    ("tensorflow_datasets", "OpenCV is not installed"),  # grain's image decoding: Pillow is what vitmm uses
    ("orbax", "read_only=True, setting save_interval_steps=0"),  # reading another run's checkpoints
    ("orbax", "CheckpointManagerOptions.read_only=True, setting save_interval_steps=0"),  # the same, worded so
    ("orbax", "`read_only` is True"),
    ("orbax", "Given directory is read only"),
    ("orbax", 'Item "data" was found in the checkpoint, but could not be restored'),  # a params-only restore
    ("orbax", 'Item "meta" was found in the checkpoint, but could not be restored'),
    ("orbax", 'Item "state" was found in the checkpoint, but could not be restored'),
)
LIBRARIES = ("/orbax/", "/tensorstore/", "/asyncio/")  # whose errors a failed save or restore floods


class _Expected(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        return not any(part in record.pathname and message.startswith(start) for part, start in EXPECTED)


_EXPECTED = _Expected()


def _handlers() -> list[logging.Handler]:
    from absl import logging as absl_logging

    return [absl_logging.get_absl_handler(), *logging.getLogger().handlers]


def quiet(verbose: bool = False) -> None:
    """Warnings a healthy run prints (``EXPECTED``) off the console, unless ``verbose``, which
    also turns absl's INFO lines back on. Safe to call more than once."""
    from absl import flags
    from absl import logging as absl_logging

    absl_logging.use_absl_handler()  # what app.run does; chat and serve do not run under it
    if not flags.FLAGS.is_parsed():  # their argparse flags are parsed: absl's own (none given) are too,
        flags.FLAGS.mark_as_parsed()  # else absl says "Logging before flag parsing goes to stderr"
    absl_logging.set_verbosity(absl_logging.INFO if verbose else absl_logging.WARNING)
    for handler in set(_handlers()):
        if verbose:
            handler.removeFilter(_EXPECTED)
        elif _EXPECTED not in handler.filters:
            handler.addFilter(_EXPECTED)
    _tensorflow_banner(verbose)


def _tensorflow_banner(shown: bool) -> None:
    """TFDS's lazy ``tensorflow`` module prints its banner (``error_callback``) before it raises the
    ImportError, which is still raised. Only where TFDS is loaded (the commands that read data import
    it before calling ``quiet``): importing it here would slow the others down."""
    utils = sys.modules.get("tensorflow_datasets.core.utils.lazy_imports_utils")
    lazy = getattr(utils, "tensorflow", None)
    pending = [lazy] if hasattr(lazy, "error_callback") else []
    while pending:  # the lazy module and the submodules it made so far, which copied its callback
        module = pending.pop()
        object.__setattr__(module, "error_callback", utils.tf_error_callback if shown else None)
        pending.extend(getattr(module, "_submodules", {}).values())


class _FromLibraries(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR and any(part in record.pathname for part in LIBRARIES)


class _NotFromLibraries(_FromLibraries):
    def filter(self, record: logging.LogRecord) -> bool:
        return not super().filter(record)


class _ForeignThreadsTo:
    """``sys.stderr`` for Python code run on threads Python did not start (TensorStore's C++
    threads print their callbacks' tracebacks there): those writes go to ``file``."""

    def __init__(self, stream, file):
        self._stream, self._file = stream, file

    def write(self, text: str) -> int:
        if isinstance(threading.current_thread(), threading._DummyThread):
            return self._file.write(text)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def library_errors_to(path):
    """While active, orbax/TensorStore/asyncio errors and what foreign threads write to stderr
    go to ``path`` (appended, created on the first line), not the console."""
    file = _LazyFile(path)
    to_file = logging.StreamHandler(file)
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(pathname)s:%(lineno)d] %(message)s"))
    to_file.addFilter(_FromLibraries())
    not_libraries = _NotFromLibraries()
    console = set(_handlers())
    for handler in console:
        handler.addFilter(not_libraries)
    root = logging.getLogger()
    root.addHandler(to_file)
    stderr, sys.stderr = sys.stderr, _ForeignThreadsTo(sys.stderr, file)
    try:
        yield
    finally:
        sys.stderr = stderr
        root.removeHandler(to_file)
        for handler in console:
            handler.removeFilter(not_libraries)
        file.close()


class _LazyFile:
    """A text file opened for appending on its first write: no empty errors.log for a good run."""

    def __init__(self, path):
        self.path, self._file, self._lock = path, None, threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            if self._file is None:
                try:
                    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
                except OSError:  # no workdir (yet), or it cannot be written: the console it is
                    return sys.__stderr__.write(text)
            count = self._file.write(text)
            self._file.flush()
            return count

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


ERRORS_LOG = "errors.log"  # in the workdir


def log_error(path, what: str, err: BaseException) -> None:
    """Appends ``what`` and ``err`` with its traceback to the file at ``path`` (best effort: a
    full disk may refuse this too, and the one-line message must still be printed)."""
    import datetime
    import traceback

    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
        f.write(f"--- {datetime.datetime.now().isoformat(timespec='seconds')} {what}\n")
        f.write("".join(traceback.format_exception(err)))


_OS_ERROR = re.compile(r"\s*\[os_error_code='?\d+'?\]\s*$")
_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")  # an absl status, as TensorStore's errors start: "DATA_LOSS: ..."


def cause(err: BaseException, limit: int = 160) -> str:
    """The few words that say why a library call failed. TensorStore nests its causes on one line
    ("RESOURCE_EXHAUSTED: Error writing ...: Failed writing ...: No space left on device
    [os_error_code=28]"): the last clause, without the code. An OSError says itself ("[Errno 28] No
    space left on device"); any other error is its type and first line ("JSONDecodeError: ...")."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if not text:
        return type(err).__name__
    if _STATUS.match(text) or _OS_ERROR.search(text):
        text = _OS_ERROR.sub("", text).rsplit(": ", 1)[-1].strip() or text
    elif not isinstance(err, OSError):
        text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 1] + "…"
