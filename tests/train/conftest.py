"""A data folder for the training tests, one per worker: the smoke builds are made in it once."""

import pytest


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))
