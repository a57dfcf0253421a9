"""tools/build_wheel.py's parts that need no compiler: exporting a commit to build."""
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_wheel as bw  # noqa: E402


def _git(*args):
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=False)


@pytest.mark.skipif(shutil.which("git") is None or _git("rev-parse", "HEAD").returncode != 0,
                    reason="needs git and this repository's history")
def test_export_ref_writes_the_commits_tracked_files(tmp_path):
    dest = tmp_path / "src"
    bw.export_ref("HEAD", dest)
    for path in ("pyproject.toml", "kernels/flash/sm90_tiles.h", "tools/build_wheel.py"):
        assert (dest / path).read_text() == _git("show", f"HEAD:{path}").stdout, path
    assert not (dest / ".git").exists()
    tracked = set(_git("ls-files").stdout.split())
    assert {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()} <= tracked


def test_export_ref_names_a_bad_ref(tmp_path):
    with pytest.raises(SystemExit, match="--ref no-such-ref"):
        bw.export_ref("no-such-ref", tmp_path / "src")
