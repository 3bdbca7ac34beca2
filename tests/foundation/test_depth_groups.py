import pytest

from adamspike.depth_groups import depth_group, num_shallow_blocks, shallow_depths


def test_groups_at_70b_and_tiny():
    assert num_shallow_blocks(80) == 8
    assert shallow_depths(80) == list(range(-1, 8))
    assert [depth_group(d, 80) for d in (-1, 0, 7, 8, 79, 80)] == [
        "embed", "shallow", "shallow", "deep", "deep", "head"]
    assert [depth_group(d, 2) for d in (-1, 0, 1, 2)] == ["embed", "shallow", "deep", "head"]
    assert num_shallow_blocks(1) == 1 and num_shallow_blocks(19) == 1 and num_shallow_blocks(20) == 2


def test_bad_depths_are_errors():
    with pytest.raises(ValueError, match="depth 5"):
        depth_group(5, 4)
    with pytest.raises(ValueError, match="num_layers"):
        num_shallow_blocks(0)
