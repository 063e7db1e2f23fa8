import io
import tarfile

import pytest

from vitmm.data import scenes_builder

SMALL = "easy_32_64_16_10_s0"  # 64 train, 16 validation, 10 test records at 32x32


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A data_dir holding one small scenes build, shared by the data tests."""
    path = tmp_path_factory.mktemp("tfds")
    scenes_builder.prepare(SMALL, str(path))
    return str(path)


@pytest.fixture(scope="session")
def small_name():
    return SMALL


@pytest.fixture(scope="session")
def write_tar():
    """``write_tar(path, [(member name, bytes), ...])`` writes a tar shard and returns its path."""
    def write(path, members) -> str:
        with tarfile.open(path, "w") as tar:
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return str(path)
    return write
