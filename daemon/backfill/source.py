"""Where the backfill reads segments: a local directory, or an archive on S3 or HDFS.

`--segments` takes paths, `file://` URIs, `s3://bucket/prefix` (any S3-compatible endpoint) and
`hdfs://namenode:port/path`, comma-separated for a multi-path CommitLog. The driver lists them
(`SegmentListing`: the broker's layout rules, as `CommitLog` applies them to a local directory) and each
task opens the one segment it decodes as an *image*, a buffer of the segment's size in which the decoder
finds every record at its in-segment position:

* a local file is mapped (`mmap`), as `reputd rebuild` maps it;
* a remote object is read into a private anonymous mapping of the segment's size, `readBytes` at a time
  with the next read issued before the current one is decoded (pyarrow.fs releases the GIL), and pages
  behind the decoder are dropped. Only the ranges a task needs are ever read and only a few reads are
  resident, so a worker's memory does not depend on the segment size.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

from daemon.config import DEFAULT_S3_REQUEST_TIMEOUT_SECONDS
from indexcore.commitlog import RECORD_PREFIX
from indexcore.errors import StoreLayoutError
from indexcore.mappedfile import FILE_NAME_DIGITS, offset_to_file_name
from indexcore.reader import CommitLog

LOCAL, S3, HDFS = "file", "s3", "hdfs"
SCHEMES = (LOCAL, S3, HDFS)
S3_CONNECT_TIMEOUT_SECONDS = 10
AWS_ENV = ("AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@dataclass(frozen=True, slots=True)
class S3Options:
    """Endpoint, region and credentials for s3:// (from the config, else the AWS_* environment)."""

    endpoint: str | None = None
    region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    request_timeout: int = DEFAULT_S3_REQUEST_TIMEOUT_SECONDS

    @classmethod
    def resolve(cls, backfill_config, env: Mapping[str, str] | None = None) -> S3Options:
        env = os.environ if env is None else env
        return cls(backfill_config.s3_endpoint or env.get("AWS_ENDPOINT_URL") or None,
                   backfill_config.s3_region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None,
                   backfill_config.s3_access_key_id or env.get("AWS_ACCESS_KEY_ID") or None,
                   backfill_config.s3_secret_access_key or env.get("AWS_SECRET_ACCESS_KEY") or None,
                   backfill_config.s3_request_timeout_seconds)

    def __repr__(self) -> str:  # never print the secret
        return f"S3Options(endpoint={self.endpoint!r}, region={self.region!r})"


@dataclass(frozen=True, slots=True)
class SegmentDir:
    """One CommitLog directory: `path` is a local path, `bucket/prefix` on S3, or the path on HDFS."""

    scheme: str
    path: str
    authority: str = ""  # the namenode host:port of hdfs://

    @property
    def uri(self) -> str:
        if self.scheme == LOCAL:
            return self.path
        if self.scheme == S3:
            return f"s3://{self.path}"
        return f"hdfs://{self.authority}{self.path}"

    def child(self, name: str) -> str:
        return os.path.join(self.uri, name) if self.scheme == LOCAL else f"{self.uri.rstrip('/')}/{name}"


def parse_segment_dirs(spec: str) -> tuple[SegmentDir, ...]:
    """`--segments`: paths and file://, s3:// or hdfs:// URIs, comma-separated; ValueError otherwise."""
    dirs = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        uri = urlparse(part)
        scheme = uri.scheme.lower()
        if scheme in ("", LOCAL):
            if scheme and uri.netloc not in ("", "localhost"):
                raise ValueError(f"--segments {part}: a file:// URI names a local path (file:///dir), not host "
                                 f"{uri.netloc}")
            dirs.append(SegmentDir(LOCAL, os.path.abspath(os.path.expanduser(uri.path if scheme else part))))
        elif scheme == S3:
            if not uri.netloc:
                raise ValueError(f"--segments {part}: an s3:// URI names a bucket (s3://bucket/prefix)")
            dirs.append(SegmentDir(S3, f"{uri.netloc}{uri.path}".rstrip("/")))
        elif scheme == HDFS:
            dirs.append(SegmentDir(HDFS, uri.path.rstrip("/") or "/", uri.netloc))
        else:
            raise ValueError(f"--segments {part}: {uri.scheme}:// is not supported; give a path, file://, s3:// "
                             f"(any S3-compatible store) or hdfs://")
    if not dirs:
        raise ValueError("--segments names no directory")
    if len({d.scheme for d in dirs}) > 1:
        raise ValueError(f"--segments {spec}: all directories must use one scheme")
    return tuple(dirs)


def remote_filesystem(d: SegmentDir, s3: S3Options):
    """The pyarrow.fs file system of a remote directory (imported here: only remote reads need it)."""
    from pyarrow import fs  # noqa: PLC0415

    if d.scheme == S3:
        endpoint = s3.endpoint
        scheme = "https"
        if endpoint and "://" in endpoint:
            scheme, endpoint = endpoint.split("://", 1)
        return fs.S3FileSystem(access_key=s3.access_key, secret_key=s3.secret_key, region=s3.region or "us-east-1",
                               endpoint_override=endpoint, scheme=scheme, allow_bucket_creation=False,
                               request_timeout=s3.request_timeout, connect_timeout=min(s3.request_timeout,
                                                                                       S3_CONNECT_TIMEOUT_SECONDS))
    host, _, port = d.authority.partition(":")
    try:
        return fs.HadoopFileSystem(host or "default", int(port) if port else 0)
    except OSError as e:
        raise StoreLayoutError(d.uri, f"cannot reach HDFS ({e}); HDFS needs libhdfs (HADOOP_HOME or "
                                      f"ARROW_LIBHDFS_DIR), a Java runtime and the Hadoop CLASSPATH") from None


@dataclass(frozen=True, slots=True)
class Segment:
    start: int
    location: str  # local path, or the path within the remote file system
    written_successor: bool = True  # a later segment holds data (decides end-of-data against corruption)


class SegmentListing:
    """The segments of a CommitLog wherever it lives, checked as the broker checks its directory: 20-digit
    names at multiples of the segment size, every file of the configured size."""

    def __init__(self, dirs: Sequence[SegmentDir], segment_size: int, s3: S3Options | None = None):
        self.dirs = tuple(dirs)
        self.segment_size = segment_size
        self.s3 = s3 or S3Options()
        self.scheme = self.dirs[0].scheme
        if self.scheme == LOCAL:
            self.local = CommitLog([d.path for d in self.dirs], segment_size)
            found = self.local.segments
        else:
            self.local = None
            found = self._list_remote()
        heads = self._written_flags([loc for _, loc in found])
        self.segments = [Segment(start, loc, heads[i]) for i, (start, loc) in enumerate(found)]

    def _list_remote(self) -> list[tuple[int, str]]:
        from pyarrow import fs  # noqa: PLC0415

        found = []
        for d in self.dirs:
            filesystem = remote_filesystem(d, self.s3)
            try:
                infos = filesystem.get_file_info(fs.FileSelector(d.path, allow_not_found=False))
            except (OSError, FileNotFoundError) as e:
                raise StoreLayoutError(d.uri, f"cannot list the CommitLog directory: {e}") from None
            for info in infos:
                if info.type == fs.FileType.Directory:
                    continue
                name = info.base_name
                where = f"{d.uri}/{name}"
                if len(name) != FILE_NAME_DIGITS or not name.isdigit():
                    raise StoreLayoutError(where, "not a mapped file: names must be 20-digit start offsets")
                start = int(name)
                if start % self.segment_size:
                    raise StoreLayoutError(where, f"start offset is not a multiple of the segment size "
                                                  f"{self.segment_size}")
                if info.size != self.segment_size:
                    raise StoreLayoutError(where, f"segment is {info.size} bytes, mappedFileSizeCommitLog is "
                                                  f"{self.segment_size}")
                found.append((start, self._remote_location(d, info.path)))
        return sorted(found)

    def _remote_location(self, d: SegmentDir, path: str) -> str:
        """The URI of a listed file (pyarrow.fs gives bucket/key on S3 and an absolute path on HDFS)."""
        return SegmentDir(d.scheme, path if d.scheme == S3 else "/" + path.lstrip("/"), d.authority).uri

    def _written_flags(self, locations: list[str]) -> list[bool]:
        """For each segment, whether a later one holds data: its first TOTALSIZE is not zero (a broker
        pre-allocates its next file before the current one is full). Reads heads from the newest down."""
        flags = [False] * len(locations)
        seen = False
        for i in range(len(locations) - 1, -1, -1):
            flags[i] = seen
            if not seen:
                head = read_head(locations[i], RECORD_PREFIX.size, self.s3)
                seen = len(head) == RECORD_PREFIX.size and RECORD_PREFIX.unpack(head)[0] != 0
        return flags

    @property
    def min_offset(self) -> int:
        return self.segments[0].start if self.segments else 0

    def segment_start(self, offset: int) -> int:
        return offset - offset % self.segment_size

    def missing(self, offset: int) -> str:
        """The name a missing segment would have."""
        return self.dirs[0].child(offset_to_file_name(self.segment_start(offset)))


def read_head(location: str, n: int, s3: S3Options) -> bytes:
    if "://" not in location:
        with open(location, "rb") as f:
            return f.read(n)
    filesystem, path = open_remote(location, s3)
    with filesystem.open_input_file(path) as f:
        return f.read_at(n, 0)


def open_remote(location: str, s3: S3Options):
    """The file system and in-file-system path of a remote segment's URI."""
    d = parse_segment_dirs(location)[0]
    return remote_filesystem(d, s3), d.path


# --- images: a segment as the decoder sees it ---------------------------------------------------------------

class LocalImage:
    """A local segment, mapped read-only."""

    remote = False

    def __init__(self, path: str, size: int):
        self.path = path
        with open(path, "rb") as f:
            actual = os.fstat(f.fileno()).st_size  # before mapping: an empty file cannot be mapped at all
            if actual != size:
                raise StoreLayoutError(path, f"segment is {actual} bytes, mappedFileSizeCommitLog is {size}")
            self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def ensure(self, start: int, end: int) -> None:
        """Make [start, end) readable (always, for a mapped file)."""

    def next_data(self, pos: int) -> int:
        """Where the file's next data at or after `pos` is (SEEK_DATA: holes read as zeros), or its size."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:
            return len(self.buffer)  # no data past pos (ENXIO), or no SEEK_DATA here: nothing to skip
        finally:
            os.close(fd)

    def release(self, start: int, end: int) -> None:
        from indexcore.reader import release_pages  # noqa: PLC0415

        release_pages(self.buffer, start, end)

    def close(self) -> None:
        self.buffer.close()


class RemoteImage:
    """A remote segment read into a private anonymous mapping of its size, `read_bytes` per read, the next
    read in flight while the caller decodes. Reads only move forward; `release` gives pages back. Nothing
    is read ahead past `ahead_limit` (the end of the task's range): beyond it only the bytes asked for are
    read, so a range costs its own bytes and what its last record needs, not a discarded read."""

    remote = True

    def __init__(self, location: str, size: int, read_bytes: int, s3: S3Options, ahead_limit: int | None = None):
        self.location = location
        self.size = size
        self.read_bytes = read_bytes
        self.ahead_limit = size if ahead_limit is None else min(size, ahead_limit)
        filesystem, path = open_remote(location, s3)
        try:
            self._file = filesystem.open_input_file(path)
        except (OSError, FileNotFoundError) as e:
            raise StoreLayoutError(location, f"cannot open: {e}") from None
        if self._file.size() != size:
            raise StoreLayoutError(location, f"segment is {self._file.size()} bytes, mappedFileSizeCommitLog is "
                                             f"{size}")
        self.buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._filled_from = self._filled_to = 0  # the bytes [from, to) are in the buffer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="reputd-read")
        self._ahead: tuple[int, Future] | None = None
        self._lock = threading.Lock()
        self.bytes_read = 0  # every byte requested, read ahead or not

    @property
    def filled_to(self) -> int:
        return self._filled_to

    def _read(self, at: int, n: int) -> int:
        data = self._file.read_at(n, at)
        if len(data) != n:
            raise StoreLayoutError(self.location, f"short read: {len(data)} of {n} bytes at {at}")
        self.buffer[at : at + n] = data
        with self._lock:
            self.bytes_read += n
        return at + n

    def _next_read(self, at: int, end: int) -> int:
        """How many bytes to read at `at` to reach `end`: whole reads inside the range, exactly what is asked
        for past it."""
        n = min(self.read_bytes, self.size - at)
        if at + n > self.ahead_limit:
            n = max(min(n, self.ahead_limit - at), min(end - at, self.size - at))
        return n

    def ensure(self, start: int, end: int) -> None:
        end = min(end, self.size)
        if start < self._filled_from or start > self._filled_to:  # a jump: start reading there
            self._drain()
            self._filled_from = self._filled_to = start - start % mmap.PAGESIZE
        while self._filled_to < end:
            if self._ahead is not None and self._ahead[0] == self._filled_to:
                self._filled_to = self._ahead[1].result()
                self._ahead = None
            else:
                self._drain()
                self._filled_to = self._read(self._filled_to, self._next_read(self._filled_to, end))
        if self._ahead is None and self._filled_to < self.ahead_limit:
            at = self._filled_to
            self._ahead = (at, self._pool.submit(self._read, at, min(self.read_bytes, self.ahead_limit - at)))

    def next_data(self, pos: int) -> int:
        return pos

    def _drain(self) -> None:
        if self._ahead is not None:
            self._ahead[1].result()
            self._ahead = None

    def release(self, start: int, end: int) -> None:
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        last = end - end % mmap.PAGESIZE
        if last > first:
            self.buffer.madvise(mmap.MADV_DONTNEED, first, last - first)
            self._filled_from = max(self._filled_from, last)

    def close(self) -> None:
        try:
            self._drain()
        finally:
            self._pool.shutdown()
            self._file.close()
            self.buffer.close()


def open_image(location: str, size: int, read_bytes: int, s3: S3Options, ahead_limit: int | None = None):
    if "://" in location:
        return RemoteImage(location, size, read_bytes, s3, ahead_limit)
    return LocalImage(location, size)
