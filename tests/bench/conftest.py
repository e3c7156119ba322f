"""What the bench tests share: the tiny target of tests/conftest.py and a block-4 drafter for it."""

import pytest

from pdflash.target.tiny import write_tiny_drafter


@pytest.fixture(scope="module")
def pair(tiny_target, tmp_path_factory):
    """(target dir, drafter dir): the session's tiny target and a tiny DFlash drafter of block 4."""
    return tiny_target, write_tiny_drafter(tmp_path_factory.mktemp("bench-drafter"), tiny_target, block_size=4)
