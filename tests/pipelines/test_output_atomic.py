"""Outputs are written all or nothing: a full disk (ENOSPC from the encoder, the write or the fsync)
or an encoder that leaves a truncated MP4 raises OSError, leaves no file (and no temporary file)
behind, and an existing file is untouched; the CLI reports it as one ``error:`` line."""

import errno
import os

import numpy as np
import pytest

from ditattn.errors import AttentionConfigError
from ditattn.pipelines import output
from ditattn.pipelines.output import OutputCheckError, mp4_video_frames, save_frames, save_video


def _frames(n=5, h=32, w=48, seed=0):
    return (np.random.RandomState(seed).rand(n, h, w, 3) * 255).astype(np.uint8)


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_mp4_is_checked_and_frame_count_read_from_moov(tmp_path):
    path = save_frames(_frames(9, 30, 46), str(tmp_path / "a.mp4"))  # odd sizes: padded to even
    assert mp4_video_frames(path) == 9
    data = open(path, "rb").read()
    for cut in (len(data) - 1, len(data) // 2, 30, 0):
        (tmp_path / "cut.mp4").write_bytes(data[:cut])
        with pytest.raises(OutputCheckError, match="truncated|empty"):
            mp4_video_frames(str(tmp_path / "cut.mp4"))
    (tmp_path / "png.mp4").write_bytes(open(save_frames(_frames(1), str(tmp_path / "x.png")), "rb").read())
    with pytest.raises(OutputCheckError):
        mp4_video_frames(str(tmp_path / "png.mp4"))


@pytest.mark.parametrize("where", ["fsync", "encoder"])
def test_full_disk_leaves_no_file_and_keeps_the_old_one(tmp_path, monkeypatch, where):
    target = tmp_path / "clip.mp4"
    target.write_bytes(b"old")
    if where == "fsync":
        monkeypatch.setattr(output.os, "fsync", _enospc)
    else:
        import imageio.v2 as imageio

        real = imageio.get_writer

        def writer(*a, **k):
            w = real(*a, **k)
            w.append_data = _enospc
            return w

        monkeypatch.setattr(imageio, "get_writer", writer)
    with pytest.raises(OSError) as exc:
        save_frames(_frames(), str(target))
    assert exc.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["clip.mp4"]


def test_truncated_encoder_output_is_detected(tmp_path, monkeypatch):
    import imageio.v2 as imageio

    real = imageio.get_writer

    def writer(path, *a, **k):
        w = real(path, *a, **k)
        close = w.close

        def truncated_close():
            close()
            with open(path, "r+b") as f:  # the encoder "succeeded" but the file lost its tail
                f.truncate(os.path.getsize(path) // 2)

        w.close = truncated_close
        return w

    monkeypatch.setattr(imageio, "get_writer", writer)
    with pytest.raises(OutputCheckError, match="truncated"):
        save_frames(_frames(), str(tmp_path / "t.mp4"))
    assert os.listdir(tmp_path) == []


def test_wrong_frame_count_is_detected(tmp_path, monkeypatch):
    monkeypatch.setattr(output, "mp4_video_frames", lambda path: 3)
    with pytest.raises(OutputCheckError, match="holds 3 frame"):
        save_frames(_frames(5), str(tmp_path / "f.mp4"))
    assert os.listdir(tmp_path) == []


def test_png_full_disk_and_short_write(tmp_path, monkeypatch):
    import ditattn.files as files

    monkeypatch.setattr(files.os, "fsync", _enospc)
    with pytest.raises(OSError, match="No space"):
        save_frames(_frames(1), str(tmp_path / "a.png"))
    monkeypatch.undo()
    real_fstat = os.fstat

    class Short:
        def __init__(self, st):
            self.st_size = st.st_size - 1

    monkeypatch.setattr(files.os, "fstat", lambda fd: Short(real_fstat(fd)))
    with pytest.raises(OSError, match="short write"):
        save_frames(_frames(1), str(tmp_path / "b.png"))
    assert os.listdir(tmp_path) == []


def test_save_video_and_generate_report_a_full_disk_as_one_error(tmp_path, monkeypatch):
    monkeypatch.setattr(output.os, "fsync", _enospc)
    with pytest.raises(AttentionConfigError, match="cannot write .*No space left on device"):
        save_video(_frames(), str(tmp_path / "v.mp4"))
    from ditattn.entrypoints import generate
    from ditattn.runconfig import RunConfig

    cfg = RunConfig.from_mapping({"prompt": "x", "output_path": str(tmp_path / "g.mp4")}, source="test")
    with pytest.raises(AttentionConfigError, match="cannot write .*g.mp4: No space left on device"):
        generate._write(cfg, _frames(), 5)
    assert os.listdir(tmp_path) == []
