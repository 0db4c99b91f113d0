"""This project's top-level ``kernels`` package shares its import name with Hugging Face's
``kernels`` distribution, which transformers probes (``is_kernels_available``) and, from
5.25 on, requires. The import must resolve to ours, and transformers must not take ours for
HF's: it reads the version of the distribution owning the import name (this project's)."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

from packaging.version import Version
from transformers.utils import import_utils

ROOT = Path(__file__).resolve().parents[1]
CONTRACT_RELEASE = Version("5.24")  # Lfm3 came in 5.23; the README states what 5.24 writes


def test_kernels_is_this_projects_package() -> None:
    import kernels

    assert Path(kernels.__file__).resolve().parent == ROOT / "kernels"
    assert hasattr(kernels, "native_ops") or (ROOT / "kernels" / "native_ops.py").is_file()


def test_transformers_does_not_take_ours_for_hf_kernels() -> None:
    ours = Version(importlib.metadata.version("hybridserve"))
    low, high = Version(import_utils.KERNELS_MIN_VERSION), Version(import_utils.KERNELS_MAX_VERSION)
    assert not low <= ours <= Version(f"{high.major}.{high.minor}.999"), (
        f"hybridserve {ours} falls in HF kernels' accepted range [{low}, {high}]"
    )
    assert not import_utils.is_kernels_available()


def test_transformers_floor_has_every_served_class() -> None:
    """The installed transformers has every architecture the registry serves, and the pin's
    floor is no older than the release the README's config contract is written against."""
    import transformers

    from workers.models import SUPPORTED_ARCHITECTURES

    missing = [name for name in SUPPORTED_ARCHITECTURES if not hasattr(transformers, name)]
    assert not missing, f"transformers {transformers.__version__} lacks {missing}"
    pins = [
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("transformers")
    ]
    floor = Version(pins[0].split(">=")[1].split(",")[0])
    assert floor >= CONTRACT_RELEASE, f"transformers floor {floor} < {CONTRACT_RELEASE}"
