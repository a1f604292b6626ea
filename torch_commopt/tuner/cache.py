"""Persistent tuner cache: calibrations and measured choices, remembered across runs.

One JSON file per entry under the cache directory, named by the digest of its key (a
dict of everything that changes the answer: device, world size, topology, versions, op,
shapes, candidates).  The file stores its key too, so a collision or a stale file is
detected instead of trusted.

Never breaks a run: writes are atomic (a complete temporary file in the same directory,
then `os.replace`), so a reader sees the old entry or the new one, never half of one; two
processes writing one key both write complete answers and the last rename wins; a file
that does not parse, or holds another key, is logged, ignored and overwritten by the next
`put`; a directory that cannot be written only costs the remembering.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import tempfile
from typing import Any

from torch_commopt.core import env

log = logging.getLogger("torch_commopt.tuner.cache")

CACHE_ENV = env.CACHE_DIR
FORMAT_VERSION = 1


def default_dir() -> pathlib.Path:
    """$TORCH_COMMOPT_CACHE_DIR, else $XDG_CACHE_HOME/torch_commopt, else ~/.cache/torch_commopt
    (core/env.py)."""
    return env.cache_dir()


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:32]


class TunerCache:
    def __init__(self, root: str | os.PathLike | None = None):
        self.root = pathlib.Path(root) if root is not None else default_dir()

    def path(self, key: dict[str, Any]) -> pathlib.Path:
        return self.root / f"{key_digest(key)}.json"

    def get(self, key: dict[str, Any]) -> Any | None:
        """The stored value for `key`, or None (missing, unreadable, corrupt, other key)."""
        path = self.path(key)
        try:
            entry = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("commopt tuner cache: ignoring unreadable entry %s (%s)", path, e)
            return None
        if not isinstance(entry, dict) or entry.get("version") != FORMAT_VERSION or "value" not in entry:
            log.warning("commopt tuner cache: ignoring malformed entry %s", path)
            return None
        if entry.get("key") != json.loads(json.dumps(key, sort_keys=True, default=str)):
            log.warning("commopt tuner cache: entry %s holds another key; ignoring it", path)
            return None
        return entry["value"]

    def put(self, key: dict[str, Any], value: Any) -> bool:
        """Store atomically; False (logged) if the directory cannot be written."""
        entry = {"version": FORMAT_VERSION, "key": key, "value": value}
        try:
            text = json.dumps(entry, sort_keys=True, default=str)
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path(key))
            except BaseException:
                pathlib.Path(tmp).unlink(missing_ok=True)
                raise
        except (OSError, TypeError, ValueError) as e:
            log.warning("commopt tuner cache: could not write %s (%s); continuing without it", self.root, e)
            return False
        return True
