"""Repack a wheel without some of its files: what the slim_* scripts share."""

import zipfile
from collections.abc import Callable
from pathlib import Path


def repack(wheel: Path, out_dir: Path, drop: Callable[[str], bool]) -> Path:
    """Copy ``wheel`` into ``out_dir`` without the files ``drop`` names; RECORD lists only the
    files kept (pip checks that every listed file exists)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {n for n in src.namelist() if drop(n)}
        for item in src.infolist():
            if item.filename in dropped:
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",")[0] not in dropped).encode()
            dst.writestr(item, data)
    return out
