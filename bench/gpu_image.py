"""A fresh venv holding only what the GPU machine's image has, for rehearsing the device call here.

``bench/gpu_check.sh --rehearse`` runs the device call on this machine: this venv, the carried wheels installed with
``pip --no-index``, the network refused, then the check's CPU mode. Every packaging mistake that would make the
GPU run fail before it measures anything (a module the image lacks, a preset missing from what travels) fails here
first, at no device time.

The image (``/work/.library/device/KINDS.md``: Python 3.12, torch 2.11, numpy, transformers, ...) cannot be
downloaded; its packages are taken from the running environment instead: the distributions named in ``IMAGE``
and everything they require, linked (not copied) into the new venv's site-packages, so that making it costs about
a second and no network. Versions are this environment's (torch 2.13.0 here against 2.11.0 there); what the
rehearsal proves is which packages are present, not their versions. The project itself, megatron-core, omegaconf
and submitit must come from the carried files: a closure that reaches them is an error.

Run: ``.venv/bin/python bench/gpu_image.py DIR`` prints DIR/bin/python.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import re
import subprocess
import sys
from pathlib import Path

IMAGE = ("torch", "numpy", "transformers", "safetensors", "pyyaml", "psutil", "tqdm", "packaging", "pytest",
         "cloudpickle", "pip")
"""Distributions the GPU image holds that the check uses (its full list is far longer); their requirements come
along."""
CARRIED = ("megatron-rl", "megatron-core", "omegaconf", "submitit")
"""What the device call brings itself (the checkout and build/gpu_wheels): never taken from this environment."""


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...] = IMAGE) -> dict[str, metadata.Distribution]:
    """The installed distributions ``roots`` and what they require (markers evaluated here; extras left out)."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = _key(todo.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_image: {name} is not installed in {sys.prefix}: install the project's dev "
                             f"extras (bash tests/run.sh) first")
        found[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    carried = sorted(set(found) & {_key(n) for n in CARRIED})
    if carried:
        raise SystemExit(f"gpu_image: {', '.join(carried)} would come from this environment, not the carried files")
    return found


def top_level_entries(dist: metadata.Distribution) -> set[str]:
    """The names a distribution puts directly in site-packages (packages, modules, its dist-info)."""
    entries = set()
    for path in dist.files or []:
        first = path.parts[0]
        if first != ".." and not first.startswith("__pycache__"):
            entries.add(first)
    return entries


def make(target: Path) -> Path:
    """A venv at ``target`` (made again) with the image's distributions linked in; its python."""
    dists = closure()
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for dist in dists.values():
        source = Path(str(dist.locate_file("")))
        for entry in top_level_entries(dist):
            if (source / entry).exists() and not (site / entry).exists():
                (site / entry).symlink_to(source / entry)
    return python


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("target", type=Path)
    print(make(parser.parse_args().target.resolve()))


if __name__ == "__main__":
    main()
