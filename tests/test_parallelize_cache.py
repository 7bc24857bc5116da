"""torch.compile's kernel cache: a cache folder that cannot be made is a note, not inductor's
NotADirectoryError / FileNotFoundError traceback at the first compile."""

import os

import pytest

from gptspeed.parallelize import compile_cache_dir, use_compile_cache


@pytest.mark.parametrize("where", ["a file", "/proc"])
def test_a_compile_cache_that_cannot_be_made_falls_back_with_a_note(tmp_path, monkeypatch, capsys, where):
    if where == "a file":
        root = tmp_path / "cache"
        root.write_text("not a folder")
    else:
        root = "/proc/gptspeed-cache"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # restored after the test
    monkeypatch.setenv("GPTSPEED_CACHE", str(root))
    wanted = compile_cache_dir()
    path = use_compile_cache()
    assert path != wanted and path.is_dir() and os.access(path, os.W_OK)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)  # where inductor writes its kernels now
    note = capsys.readouterr().out
    assert f"note: the compile cache {wanted} cannot be made" in note and "set $GPTSPEED_CACHE" in note


def test_a_writable_compile_cache_is_used(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("GPTSPEED_CACHE", str(tmp_path / "new" / "cache"))
    assert use_compile_cache() == tmp_path / "new" / "cache" / "inductor"
    assert (tmp_path / "new" / "cache" / "inductor").is_dir()
