"""docs/architecture.md, "Layers": the folders at the top of the repository install under one name
of ours, ``fnkernel`` — never as ``kernel`` or ``adapters``, which are other projects' names on
the package index — and fnkernel works with those projects installed beside it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT

pytestmark = pytest.mark.slow  # it builds and installs the wheel (tests/conftest.py)

FOLDERS = ("runtime_server", "adapters", "kernel", "system")


def configured() -> dict[str, object]:
    setuptools: dict[str, object] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"][
        "setuptools"
    ]
    return setuptools


def test_every_package_of_the_folders_is_installed() -> None:
    on_disk = {
        "fnkernel." + ".".join(init.parent.relative_to(ROOT).parts)
        for folder in FOLDERS
        for init in (ROOT / folder).rglob("__init__.py")
    }
    packages = set(configured()["packages"])  # type: ignore[arg-type]
    assert on_disk <= packages
    # Besides them, only folders of data (the kernelspec's logos), named so that setuptools
    # installs their files without warning that an importable folder is not configured.
    for data in packages - on_disk:
        folder = ROOT.joinpath(*data.split(".")[1:])
        assert folder.is_dir() and not list(folder.glob("*.py")), data


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of what the build reads: setuptools keeps its build/ in the
    source tree, where a module removed since an earlier build would still be packaged."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(out), str(source)],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    [built] = out.glob("fnkernel-*.whl")
    return built


def test_the_wheel_claims_no_name_but_fnkernel(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"fnkernel"}
    # the package data travels with it: the Bash worker and the kernelspec's logo
    assert "fnkernel/adapters/bash_runner.sh" in names
    assert "fnkernel/kernel/resources/logo-64x64.png" in names
    assert "fnkernel/runtime_server/_proto/executor/v1/runtime_pb2.py" in names


def test_the_demo_runs_with_the_index_kernel_and_adapters_installed_beside_it(
    wheel: Path, tmp_path: Path
) -> None:
    # A fresh venv: fnkernel from its wheel, then `pip install kernel adapters` (the index's
    # projects of those names), then the demo notebook through the installed kernelspec. The
    # dependencies come from the test's own environment (a .pth line), so only the two projects
    # are fetched.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    [site_packages] = (venv / "lib").glob("python3*/site-packages")
    ours = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site_packages / "dependencies.pth").write_text(f"{ours}\n")

    def pip(*args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
             "--no-deps", *args],
            check=True, timeout=300, capture_output=True,
        )  # fmt: skip

    pip(str(wheel))
    pip("kernel", "adapters")
    for other in ("kernel", "adapters"):
        assert (site_packages / other / "__init__.py").is_file(), f"{other} is not installed"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTHON"))}
    env["JUPYTER_PATH"] = str(venv / "share" / "jupyter")
    subprocess.run(
        [str(python), "-m", "fnkernel.runtime_server.cli", "install", "--sys-prefix"],
        check=True, timeout=60, env=env, cwd=tmp_path, capture_output=True,
    )  # fmt: skip
    spec = json.loads((venv / "share/jupyter/kernels/fnkernel/kernel.json").read_text())
    assert spec["argv"][:4] == [str(python), "-P", "-m", "fnkernel.kernel"]
    demo = subprocess.run(
        [str(python), "-m", "fnkernel.kernel.demo", str(ROOT / "notebooks" / "quickstart.ipynb")],
        timeout=240, env=env, cwd=tmp_path, capture_output=True, text=True,
    )  # fmt: skip
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "every cell ran" in demo.stdout
    # the index's projects are untouched by ours
    assert "fnkernel" not in (site_packages / "kernel" / "__init__.py").read_text()
