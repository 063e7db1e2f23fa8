"""A module-wide data folder for the training tests."""

import pytest


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))
