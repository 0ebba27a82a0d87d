"""A wheelhouse a test makes, so no test reaches a package index (docs/protocol.md,
"Requirements"): tiny pure-Python wheels written as the wheel format says (PEP 427: the
package, then its ``.dist-info`` with METADATA, WHEEL and a RECORD of every file's hash).

``fnk-alpha`` exists at 1.0 and 2.0, ``fnk-beta`` 1.0 depends on ``fnk-alpha>=1``; each module
says its version (``VERSION``) and where it was imported from (``__file__``).
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

# name -> versions -> what it requires
PACKAGES: dict[str, dict[str, list[str]]] = {
    "fnk-alpha": {"1.0": [], "2.0": []},
    "fnk-beta": {"1.0": ["fnk-alpha>=1"]},
}


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def build_wheel(directory: Path, name: str, version: str, requires: list[str]) -> Path:
    """Write the wheel of `name` `version` into `directory`; its path."""
    module = name.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n".encode(),
        f"{dist_info}/METADATA": (
            "Metadata-Version: 2.1\n"
            f"Name: {name}\n"
            f"Version: {version}\n"
            + "".join(f"Requires-Dist: {requirement}\n" for requirement in requires)
        ).encode(),
        f"{dist_info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: fnkernel-tests\nRoot-Is-Purelib: true\n"
            b"Tag: py3-none-any\n"
        ),
    }
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in files.items():
            wheel.writestr(member, data)
    return path


def build_wheelhouse(directory: Path) -> Path:
    """Every wheel of PACKAGES in `directory` (made if missing); the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, versions in PACKAGES.items():
        for version, requires in versions.items():
            build_wheel(directory, name, version, requires)
    return directory


def offline_index(wheelhouse: Path) -> dict[str, str]:
    """The environment that points uv at `wheelhouse`, at no index, and off the network."""
    return {"UV_FIND_LINKS": str(wheelhouse), "UV_NO_INDEX": "1", "UV_OFFLINE": "1"}
