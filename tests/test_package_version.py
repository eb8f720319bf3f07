"""service.version(): what GetServerInfo and Triton's ServerMetadata report. The images run the source from
PYTHONPATH without installing it, where the package's metadata is missing: the RPCs must still answer."""

from __future__ import annotations

import importlib.metadata

import pytest

import service


def test_version_is_the_installed_one() -> None:
    assert service.version() == importlib.metadata.version(service.PACKAGE)


def test_version_without_package_metadata_is_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(service._metadata, "version", missing)
    assert service.version() == "unknown"
