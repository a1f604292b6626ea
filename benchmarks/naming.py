"""Result file names: which cards ran them (session 20 ran on 2x H100 and wrote files named h200x2)."""

from __future__ import annotations

import re


def card_tag(device_name: str, world: int) -> str:
    """'h200x2' for 'NVIDIA H200' at world 2, 'h100x2' for 'NVIDIA H100 80GB HBM3', 'gpux2' for
    a card without an H/A/B number, 'cpux2' for 'cpu' or 'CPU (gloo)'."""
    if device_name.lower().startswith("cpu"):
        return f"cpux{world}"
    found = re.search(r"\b([HABL]\d{2,3})\b", device_name)
    return f"{found.group(1).lower() if found else 'gpu'}x{world}"
