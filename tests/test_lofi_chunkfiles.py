"""The averager's local-disk I/O (chunkfiles.py): the files it writes are zarr3 that tensorstore
reads back, it reads what tensorstore wrote, and anything outside jaxscale's layout goes
through tensorstore instead."""

import os

import numpy as np
import pytest
import tensorstore as ts

from jaxscale.lofi import store as S
from jaxscale.lofi.chunkfiles import ChunkFiles
from jaxscale.lofi.kv import _HASH, Store, chunk_sums

CHUNK = 8


def _read_ts(st: Store, key: str) -> np.ndarray:
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": st.spec["path"] + key}}
    return ts.open(spec, open=True).result().read().result()


def test_written_chunk_files_are_zarr3_that_tensorstore_reads(tmp_path):
    st = Store(str(tmp_path), chunk=CHUNK)
    values = np.arange(1, 21, dtype=np.float32)  # 2.5 chunks: the last one is padded
    st.array("x", values.size, "float32")
    files = ChunkFiles(st.spec["path"])
    for a, b in ((0, 16), (16, 20)):  # direct writes (None would mean tensorstore's)
        files.start_write("x", "float32", a, values[a:b]).result()
    assert os.path.getsize(tmp_path / "x" / "c" / "2") == CHUNK * 4
    np.testing.assert_array_equal(_read_ts(st, "x"), values)


def test_reads_what_tensorstore_wrote_with_checksums_and_zero_chunks(tmp_path):
    st = Store(str(tmp_path), chunk=CHUNK)
    values = np.arange(20, dtype=np.float32)
    values[:CHUNK] = 0  # tensorstore does not store an all-zero chunk: it reads as zeros
    st.array("x", values.size, "float32")[...] = values
    assert not (tmp_path / "x" / "c" / "0").exists()
    future = ChunkFiles(st.spec["path"]).start_read("x", "float32", CHUNK, 20,
                                                     _HASH["xxh3_128"], CHUNK)
    got, sums = future.result()
    np.testing.assert_array_equal(got, values[CHUNK:])
    assert sums == chunk_sums(values[CHUNK:], "xxh3_128", CHUNK)
    zeros, _ = ChunkFiles(st.spec["path"]).start_read("x", "float32", 0, CHUNK,
                                                      _HASH["xxh3_128"], CHUNK).result()
    assert not zeros.any()


def test_other_layouts_and_unaligned_writes_go_through_tensorstore(tmp_path):
    st = Store(str(tmp_path), chunk=CHUNK)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": st.spec["path"] + "z/"},
            "metadata": {"shape": [20], "data_type": "float32",
                         "chunk_grid": {"name": "regular",
                                        "configuration": {"chunk_shape": [CHUNK]}},
                         "codecs": [{"name": "bytes"}, {"name": "zstd"}]}}
    values = np.arange(20, dtype=np.float32)
    ts.open(spec, create=True).result()[...] = values
    files = ChunkFiles(st.spec["path"])
    assert files.start_read("z", "float32", 0, 20, _HASH["xxh3_128"], CHUNK) is None
    got, sums = st.start_read("z", "float32", 0, 20, "xxh3_128", CHUNK).result()
    np.testing.assert_array_equal(got, values)  # compressed: read by tensorstore
    assert sums is None                          # and hashed by the caller
    st.array("x", 20, "float32")
    assert files.start_write("x", "float32", 4, values[:4]) is None       # not on a boundary
    assert files.start_write("x", "float32", 0, values[:12]) is None      # ends mid-chunk
    assert files.start_write("x", "float32", 0, values.astype(np.float64)) is None


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_chunk_file_is_a_checksum_or_read_error_not_garbage(tmp_path, damage):
    st = Store(str(tmp_path))
    params = {"w": np.arange(1, 3 * S.CHUNK + 5, dtype=np.float32)}
    S.push(st, 0, 1, params, samples_seen=1)
    ckpt = S.load_checkpoint(st, S.worker_prefix(0, 1))
    chunk_file = tmp_path / ckpt.data / "arrays" / "w" / "c" / "1"
    if damage == "truncate":
        chunk_file.write_bytes(chunk_file.read_bytes()[:100])
    else:
        chunk_file.unlink()  # reads as zeros, which the manifest's checksum does not match
    expected = ("cannot read chunk data .*truncated" if damage == "truncate"
                else "checksum mismatch in chunk 1")
    with pytest.raises(S.StoreError, match=expected):
        S.read_leaf(st, ckpt, "w")


def _o_direct_supported(folder) -> bool:
    from jaxscale.lofi.chunkfiles import O_DIRECT
    if not O_DIRECT:
        return False
    try:
        os.close(os.open(os.path.join(folder, "probe"), os.O_WRONLY | os.O_CREAT | O_DIRECT))
    except OSError:
        return False
    return True


def _opened_flags(monkeypatch, refuse: str | None = None) -> list[int]:
    """Records the flags of every os.open. `refuse` makes O_DIRECT fail as filesystems do:
    "open" / "unsupported": EINVAL / EOPNOTSUPP at open (no O_DIRECT), "write": EINVAL at
    write (stricter alignment), "short": a direct write takes half its bytes."""
    import errno

    from jaxscale.lofi.chunkfiles import O_DIRECT
    flags, direct_fds, real_open, real_write = [], set(), os.open, os.write
    at_open = {"open": errno.EINVAL, "unsupported": errno.EOPNOTSUPP}

    def fake_open(path, flag, *args, **kwargs):
        flags.append(flag)
        if refuse in at_open and flag & O_DIRECT:
            raise OSError(at_open[refuse], os.strerror(at_open[refuse]))
        fd = real_open(path, flag, *args, **kwargs)
        (direct_fds.add if flag & O_DIRECT else direct_fds.discard)(fd)  # fds are reused
        return fd

    def fake_write(fd, data):
        if refuse == "write" and fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        if refuse == "short" and fd in direct_fds:
            return real_write(fd, memoryview(data)[:len(memoryview(data)) // 2])
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "write", fake_write)
    return flags


DIRECT_CHUNK = 1024  # float32: 4 KiB chunk files, the O_DIRECT alignment


def _direct_array(tmp_path, size: int) -> tuple[Store, ChunkFiles, np.ndarray]:
    """A store with 4 KiB chunks, a created array "x" of `size` float32 values, and those
    values (0, 1, ...) in a page-aligned buffer."""
    from jaxscale.lofi.chunkfiles import aligned_empty
    st = Store(str(tmp_path), chunk=DIRECT_CHUNK)
    values = aligned_empty(size, np.float32)
    values[:] = np.arange(size)
    st.array("x", size, "float32")
    return st, ChunkFiles(st.spec["path"]), values


def test_output_chunk_files_bypass_the_page_cache_where_the_filesystem_allows(tmp_path,
                                                                             monkeypatch):
    from jaxscale.lofi.chunkfiles import O_DIRECT
    if not _o_direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT (the fallback is tested below)")
    st, files, values = _direct_array(tmp_path, 2 * DIRECT_CHUNK + 10)  # last chunk padded
    flags = _opened_flags(monkeypatch)
    files.start_write("x", "float32", 0, values[:DIRECT_CHUNK]).result()    # aligned buffer
    unaligned = np.concatenate([[0], values[DIRECT_CHUNK:]]).astype(np.float32)[1:]
    assert unaligned.ctypes.data % 4096  # goes through the thread's aligned bounce buffer
    files.start_write("x", "float32", DIRECT_CHUNK, unaligned).result()
    assert len(flags) == 3 and all(f & O_DIRECT for f in flags) and files.direct
    np.testing.assert_array_equal(_read_ts(st, "x"), values)


@pytest.mark.parametrize("refuse", ["open", "unsupported", "write"])
def test_filesystem_refusing_o_direct_falls_back_to_the_page_cache(tmp_path, monkeypatch,
                                                                   refuse):
    from jaxscale.lofi.chunkfiles import O_DIRECT
    if not O_DIRECT:
        pytest.skip("no O_DIRECT on this platform: every write uses the page cache")
    st, files, values = _direct_array(tmp_path, 3 * DIRECT_CHUNK)
    flags = _opened_flags(monkeypatch, refuse)
    files.start_write("x", "float32", 0, values).result()
    assert flags[0] & O_DIRECT and not files.direct           # tried once, then remembered
    assert not any(f & O_DIRECT for f in flags[1:])
    np.testing.assert_array_equal(_read_ts(st, "x"), values)  # nothing lost or half-written


def test_short_direct_write_is_redone_through_the_page_cache(tmp_path, monkeypatch):
    from jaxscale.lofi.chunkfiles import O_DIRECT
    if not _o_direct_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    st, files, values = _direct_array(tmp_path, 2 * DIRECT_CHUNK)
    flags = _opened_flags(monkeypatch, "short")
    files.start_write("x", "float32", 0, values).result()
    assert [bool(f & O_DIRECT) for f in flags] == [True, False, True, False]  # per chunk file
    assert files.direct  # a short write says nothing about the filesystem: keep trying
    assert os.path.getsize(tmp_path / "x" / "c" / "1") == DIRECT_CHUNK * 4
    np.testing.assert_array_equal(_read_ts(st, "x"), values)
