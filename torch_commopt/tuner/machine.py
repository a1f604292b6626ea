"""This machine as the tuner knows it: its name and topology, and its calibration (the same on
every rank: rank 0's cached one, else the reference priors)."""

from __future__ import annotations

import json
import logging

import torch

from torch_commopt.tuner.cache import TunerCache
from torch_commopt.tuner.calibration import Calibration, prior
from torch_commopt.tuner.decide import decide

log = logging.getLogger("torch_commopt.tuner.machine")

# Bump when what a calibration measures or how its figures are derived changes: cached
# calibrations of another format are measured anew.
CALIBRATION_FORMAT = 18
_CALIBRATIONS: dict[str, Calibration] = {}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def topology(name: str) -> str:
    """What this host's links look like, as far as torch can tell: the GPU count and whether
    every pair has peer access (NVLink or PCIe P2P); "cpu" for CPU calibrations."""
    if name == "cpu" or not torch.cuda.is_available():
        return "cpu" if name == "cpu" else "unknown"
    n = torch.cuda.device_count()
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    p2p = sum(torch.cuda.can_device_access_peer(i, j) for i, j in pairs)
    return f"{n} GPUs, peer access {'all' if p2p == len(pairs) else 'none' if p2p == 0 else 'partial'}"


def machine_key(name: str, world: int) -> dict:
    """Everything a calibration depends on: device, world size, topology, versions."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"kind": "calibration", "format": CALIBRATION_FORMAT, "device": name, "world": world,
            "topology": topology(name), "torch": torch.__version__, "triton": triton_version}


def calibration_for(device: torch.device, world: int, group_name: str | None, cache_dir: str | None,
                    timeout_s: float) -> Calibration:
    """This machine's calibration, the same on every rank: rank 0's cached one (stored by
    `python -m torch_commopt calibrate`), else the reference priors."""
    key = machine_key(device_name(device), world)
    memo = json.dumps(key, sort_keys=True) + str(cache_dir)
    if memo not in _CALIBRATIONS:
        cache = TunerCache(cache_dir)
        stored = decide(group_name, {"question": "calibration", **key}, lambda: cache.get(key), timeout_s)
        _CALIBRATIONS[memo] = _stored_or_prior(stored, key["device"], world)
    return _CALIBRATIONS[memo]


def _stored_or_prior(stored, device: str, world: int) -> Calibration:
    """The stored calibration (JSON data from the cache), else the priors, logged."""
    if stored is not None:
        try:
            return Calibration.from_json(json.dumps(stored))
        except (TypeError, ValueError, KeyError) as e:
            log.warning("commopt tuner: cached calibration for %s unusable (%s); using the prior", device, e)
    else:
        log.info("commopt tuner: %s x%d not calibrated (python -m torch_commopt calibrate); using the priors",
                 device, world)
    return prior(device, world)


def stored_calibration(device: str, world: int, cache_dir: str | None) -> Calibration:
    """The calibration the cache holds for a device name and world size (no process group:
    what the explain commands read), else the priors."""
    return _stored_or_prior(TunerCache(cache_dir).get(machine_key(device, world)), device, world)
