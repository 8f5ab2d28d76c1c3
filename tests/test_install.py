"""The project installed from its wheel (not editable) runs from an empty folder; installing keeps an installed torch.

The fresh venv borrows the dependencies of the running one through a .pth file and gets the wheel with --no-deps,
so the test needs no network; the checkout itself is never on its path.
Run: .venv/bin/python -m pytest tests/test_install.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import REPO_ROOT

PIP = ["-m", "pip", "--disable-pip-version-check"]
NOT_SOURCE = {".git", ".venv", "runs", "build", "dist", ".pytest_cache", "gpu_check_out"}


def _run(args: list, *, cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result


def _copy_of_the_checkout(dest: Path) -> Path:
    """The checkout without its venv, git data and build outputs (a stale egg-info would change the wheel)."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        top = NOT_SOURCE if Path(folder) == REPO_ROOT else set()
        return {n for n in names if n in top or n == "__pycache__" or n.endswith(".egg-info")}

    return Path(shutil.copytree(REPO_ROOT, dest, symlinks=True, ignore=ignore))


def _site_packages(python: Path) -> Path:
    return Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())


def _venv(path: Path, *, borrow_site_packages: bool) -> Path:
    _run([sys.executable, "-m", "venv", "--without-pip", path])
    python = path / "bin" / "python"
    if borrow_site_packages:
        (_site_packages(python) / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _would_install(python: Path, *requirements: str, cwd: Path | None = None) -> list[str]:
    """Names and versions ``pip install --dry-run`` would install into ``python``'s environment, offline."""
    report = _run([sys.executable, *PIP, "--python", python, "install", "-q", "--dry-run", "--no-index",
                   "--report", "-", *requirements], cwd=cwd).stdout
    return [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in json.loads(report)["install"]]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """The wheel built from a copy of the checkout, and a fresh venv that has it and the current dependencies."""
    root = tmp_path_factory.mktemp("install")
    source = _copy_of_the_checkout(root / "source")
    _run([sys.executable, *PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root / "wheels", source])
    (wheel,) = (root / "wheels").glob("megatron_rl-*.whl")
    python = _venv(root / "venv", borrow_site_packages=True)
    _run([python, *PIP, "install", "-q", "--no-deps", "--no-index", "--ignore-installed", wheel])
    empty = root / "empty"
    empty.mkdir()
    return {"source": source, "wheel": wheel, "venv": root / "venv", "python": python, "empty": empty}


def test_the_wheel_ships_the_configs_presets_and_templates(built):
    with zipfile.ZipFile(built["wheel"]) as wheel:
        shipped = {name.split("/shipped/", 1)[1] for name in wheel.namelist()
                   if name.startswith(("launcher/shipped/", "megatron_rl/spec/shipped/"))}
    in_checkout = {str(p.relative_to(REPO_ROOT)) for pattern in ("configs/*.yaml", "configs/models/*.yaml",
                                                                 "slurm/*.sbatch") for p in REPO_ROOT.glob(pattern)}
    assert shipped == in_checkout
    assert {"configs/grpo_tiny.yaml", "configs/models/llama-3.1-405b.yaml"} <= shipped


def test_the_installed_launcher_is_the_wheel_not_the_checkout(built):
    where = _run([built["python"], "-c", "import launcher, launcher.resources as r, megatron_rl.spec.resources as s; "
                  "print(launcher.__file__); print(s.configs_dir()); print(r.templates_dir())"],
                 cwd=built["empty"]).stdout.split()
    for path in where:
        assert Path(path).resolve().is_relative_to(built["venv"].resolve()), where


@pytest.mark.parametrize("args, expected", [
    (["--dry-run"], "# resolved config"),
    (["--config", "grpo_tiny", "--dry-run"], "sft_warmup_steps: 30"),
    (["--dry-run", "cluster.executor=slurm"], "#SBATCH"),
    # the error band's data ships in the wheel
    (["plan", "--model", "llama-3.1-405b", "--gpus", "1024", "--gpu-type", "h100-80gb"], "published dense pretrain runs"),
])
def test_the_installed_cli_runs_from_an_empty_folder(built, args, expected):
    result = _run([built["venv"] / "bin" / "megatron-rl", *args], cwd=built["empty"])
    assert expected in result.stdout, result.stdout[-2000:]


def _requirements(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines, extras left out."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read("megatron_rl-0.1.0.dist-info/METADATA").decode()
    return [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines()
            if line.startswith("Requires-Dist: ") and "extra ==" not in line]


def _torch(names: list[str]) -> list[str]:
    return [name for name in names if name.startswith("torch")]


def test_the_wheels_dependencies_beside_a_supported_torch_install_no_torch(tmp_path, built):
    python = _venv(tmp_path / "venv", borrow_site_packages=True)
    requirements = _requirements(built["wheel"])
    assert _torch(requirements)
    assert _torch(_would_install(python, *requirements)) == []


def test_the_cpu_dev_install_beside_a_supported_torch_installs_no_torch(built, tmp_path):
    python = _venv(tmp_path / "venv", borrow_site_packages=True)
    would_install = _would_install(python, "--no-build-isolation", "-c", "constraints/cpu.txt", "-e", ".[dev]",
                                   cwd=built["source"])
    assert "megatron-rl==0.1.0" in would_install and _torch(would_install) == []


@pytest.mark.parametrize("container_torch, kept", [
    ("2.8.0a0+5228986c39", True),   # the shape of an NGC PyTorch container's build: a pre-release with a local label
    ("2.10.0a0+b4e4ee81d3", True),
    ("2.13.0+cpu", True),
    ("2.6.0a0+ecf3bae40a", False),  # 2.6.0a0 sorts before 2.6.0
    ("2.14.0a0+0123456789", False),
])
def test_the_declared_torch_range_keeps_a_container_torch(built, tmp_path, container_torch, kept):
    python = _venv(tmp_path / "venv", borrow_site_packages=False)
    dist_info = _site_packages(python) / f"torch-{container_torch}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {container_torch}\n")
    (dist_info / "RECORD").write_text("")
    (torch,) = _torch(_requirements(built["wheel"]))
    result = _run([sys.executable, *PIP, "--python", python, "install", "-q", "--dry-run", "--no-index",
                   "--no-deps", "--report", "-", torch], check=False)
    assert (result.returncode == 0 and json.loads(result.stdout)["install"] == []) == kept, result.stderr
