"""User-facing errors: one clear line, a non-zero exit, never a traceback."""

from __future__ import annotations


class FoltrError(Exception):
    """Base of every error the CLI reports as one line (exit code 2 unless told otherwise)."""

    exit_code = 2


class DatasetError(FoltrError):
    """A dataset file could not be read: the message names file and line."""


class ScenarioError(FoltrError):
    """A scenario file is invalid: the message names file, key path and what was expected."""


class TransportError(FoltrError):
    """The transport cannot work: no server, refused key, bad key files, bad address."""
