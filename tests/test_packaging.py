"""Packaging and a fresh machine: what a new user meets before the first token.

- ``pip install pagedkv`` into an environment that already has another torch must keep it
  (pyproject declares a range; the Makefile installs the tested local build first).
- The Redis tier's tests skip with the reason, never error, where ``redis-server`` is missing.
- ``make test`` installs the system programs the suite needs (scripts/install-system-deps.sh).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_a_torch_range_that_admits_other_releases() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(Requirement(d) for d in deps if Requirement(d).name == "torch")
    assert torch.specifier.contains("2.13.0")  # the build the Makefile installs and tests
    assert torch.specifier.contains("2.5.0") and torch.specifier.contains("2.14.1")


def _fake_installed_torch(site: Path, version: str) -> None:
    """Registers ``torch==version`` as installed, metadata only: pip's resolver reads nothing
    else, and a real second torch build is several GB (only 2.13.0 lies on this disk)."""
    info = site / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "RECORD").write_text("")


@pytest.mark.slow
def test_installing_pagedkv_keeps_the_users_torch(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    _fake_installed_torch(site, "2.5.0")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--quiet",
            "--report",
            str(report),
            str(ROOT),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    would_install = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "pagedkv" in would_install
    assert "torch" not in would_install, (
        f"pip would replace the user's torch 2.5.0: {would_install['torch']}"
    )


@pytest.mark.slow
def test_redis_tests_skip_with_the_reason_without_redis_server(tmp_path: Path) -> None:
    """Without the binary on PATH every Redis test skips; none errors (the fixture used to
    raise from a test that builds its own server)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PATH"] = str(tmp_path)  # an empty directory: no redis-server
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
            str(ROOT / "tests" / "test_redis_tier.py"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    tail = proc.stdout[-2000:]
    assert proc.returncode == 0, tail
    assert "error" not in tail.splitlines()[-1] and "failed" not in tail.splitlines()[-1], tail
    assert "redis-server binary not found" in proc.stdout, tail


def test_make_test_installs_the_system_programs_first() -> None:
    plan = subprocess.run(
        ["make", "-n", "test"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    lines = plan.splitlines()
    deps = next(i for i, line in enumerate(lines) if "install-system-deps.sh" in line)
    tests = next(i for i, line in enumerate(lines) if "pytest" in line)
    assert deps < tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "install-system-deps.sh" in ci


def test_install_system_deps_is_a_no_op_when_everything_is_there(tmp_path: Path) -> None:
    """With every program present it runs no apt-get (a fake apt-get on PATH records calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "apt-calls"
    for name in ("redis-server", "chromium", "chromedriver", "cc"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "id").symlink_to(shutil.which("id"))
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 0\n')
    for f in bin_dir.iterdir():
        if not f.is_symlink():
            f.chmod(0o755)
    env = dict(os.environ, PATH=str(bin_dir))  # only the programs made here
    proc = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "install-system-deps.sh")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and not calls.exists(), proc.stderr
    (bin_dir / "redis-server").unlink()
    proc = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "install-system-deps.sh")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0
    if os.geteuid() == 0:  # as root it asks apt for exactly what is missing
        assert "install" in calls.read_text() and "redis-server" in calls.read_text()
        assert "chromium" not in calls.read_text()
    else:
        assert "missing redis-server" in proc.stderr
