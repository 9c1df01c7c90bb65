"""Durable publishing: a name that readers trust appears only once what it names is whole and on disk.

Every writer of a pointer, a marker or a finished folder goes through here (snapshots, bases,
deltas), with PostgreSQL's and SQLite's discipline on a local or network file system: write under
a temporary name, fsync the file (for a folder: every file in it, and the folder), rename it to
its final name, then fsync the directory that holds the name. After a power loss the final name
holds the old content or the new, never a name without its data, and a commit returned by these
functions survives the crash.

An fsspec object store (s3://, gs://, memory://) has neither fsync nor rename: there a single
object's write is atomic and is itself the commit, so a file is written straight to its name, and
a folder is moved (a copy, then the temporary removed); readers of a folder trust its marker file
(a snapshot's ``streamtrain.json``, a delta's ``COMPLETE``), which is written last.
"""

from __future__ import annotations

import os

import fsspec
from fsspec.implementations.local import LocalFileSystem

TEMPORARY = ".tmp"


def publish_file(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Replace the file at ``path`` with ``data``, durably and atomically."""
    if not _local(fs):
        fs.pipe_file(path, data)
        return
    temporary = path + TEMPORARY
    fs.pipe_file(temporary, data)
    _fsync(temporary)
    fs.mv(temporary, path)
    _fsync(_parent(path), directory=True)


def sync_folder(fs: fsspec.AbstractFileSystem, folder: str) -> None:
    """Make every file under ``folder``, and the folders themselves, durable (before a marker or a
    rename declares the folder finished)."""
    if not _local(fs):
        return
    for directory, _folders, files in os.walk(folder, topdown=False):
        for name in files:
            _fsync(os.path.join(directory, name))
        _fsync(directory, directory=True)


def make_folder(fs: fsspec.AbstractFileSystem, folder: str) -> None:
    """Create ``folder`` and any missing parents, each created name made durable in its parent
    (files published inside it later fsync the folder itself, not the entry that names it)."""
    if not _local(fs):
        fs.makedirs(folder, exist_ok=True)
        return
    missing = []
    path = os.path.abspath(folder)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    fs.makedirs(folder, exist_ok=True)
    for created in reversed(missing):
        _fsync(_parent(created), directory=True)


def publish_folder(fs: fsspec.AbstractFileSystem, temporary: str, final: str) -> None:
    """Make the finished folder ``temporary`` durable and rename it to ``final``, replacing any
    folder there (a replay of the same step or version)."""
    sync_folder(fs, temporary)
    if fs.exists(final):
        fs.rm(final, recursive=True)
    fs.mv(temporary, final, recursive=True)
    if _local(fs):
        _fsync(_parent(final), directory=True)


def _local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path.rstrip("/")))


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
