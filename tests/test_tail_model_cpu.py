"""tools/tail_model.py: the list-scheduling model quoted by the sm90 kernels' tail remap."""
import pathlib
import random
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import tail_model as tm  # noqa: E402


def test_makespan_of_even_blocks():
    assert tm.makespan([1.0] * 264, 132) == 2.0
    assert tm.makespan([1.0] * 265, 132) == 3.0
    assert tm.makespan([5.0, 1.0, 1.0, 1.0], 2) == 5.0


def test_remap_is_a_permutation_that_keeps_the_padding_blocks():
    rng = random.Random(0)
    for _ in range(200):
        grid = (rng.randint(1, 40), rng.randint(1, 8), 0)
        batch = rng.randint(1, 30)
        grid = (grid[0], grid[1], batch + 1)
        sms, waves = rng.choice([3, 114, 132]), rng.choice([2, 8, 1 << 20])
        every = [(x, y, z) for z in range(batch + 1) for y in range(grid[1])
                 for x in range(grid[0])]
        mapped = [tm.tail_first(x, y, z, grid, batch, sms, waves) for x, y, z in every]
        assert sorted(mapped) == sorted(every)
        assert all(m == b for m, b in zip(mapped, every) if b[2] == batch)


def test_tail_order_finishes_nearer_the_ideal_on_causal_rows():
    for kernel, d in (("bwd", 128), ("fwd", 256)):
        before = tm.over_ideal(kernel, d, 4096, 132, remap=False)
        after = tm.over_ideal(kernel, d, 4096, 132, remap=True)
        assert 1.0 <= after < before
        assert before > 1.05 and after < 1.03


def test_a_wider_tail_finishes_the_varlen_row_nearer_the_ideal():
    pytest.importorskip("numpy")  # bench.py's lengths
    two, eight = (tm.varlen_over_ideal(0, 132, w) for w in (2, 8))
    assert two > 1.03 and 1.0 <= eight < 1.02


def test_full_rows_lose_the_last_waves_emptiness():
    """bench.py's full rows have the same block count at every S (16 K tokens x H x D =
    2,048): d128's 2,048 forward items are 15.5 waves of 132, so 16 / 15.52."""
    for s in (512, 4096, 16384):
        assert tm.full_over_ideal("fwd", 128, s, 132) == pytest.approx(16 / (2048 / 132))
        assert tm.full_over_ideal("bwd", 128, s, 132) == pytest.approx(16 / (2048 / 132))
    # d64's 192-row blocks: 43 a (batch, head) at S = 8192, 2,752 items = 20.85 waves
    assert tm.full_over_ideal("fwd", 64, 8192, 132) == pytest.approx(21 / (2752 / 132))
    assert tm.full_over_ideal("fwd", 128, 1024, 128) == 1.0  # 2,048 = 16 x 128
