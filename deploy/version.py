"""pdserve's version: the installed package's, or from a checkout that is not installed, its pyproject.toml's."""

from __future__ import annotations


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("pdserve")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
            return tomllib.load(f)["project"]["version"]
