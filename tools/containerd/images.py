"""The images a containerd node needs, made from `make image`'s Debian base (tools/image/base.sh)
without a registry: the base itself for workload pods, and a sandbox image (the base told to sleep
forever) for each pod's sandbox. Both leave buildah's storage as docker-archives, which every
node imports by name (`ctr images import`); pods use them with imagePullPolicy Never."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tools.cached_tool import REPO

_BUILDAH_TIMEOUT_S = 600.0


class ImageError(RuntimeError):
    """An image could not be made or exported; the message names the step."""


def _run(argv: list[str], what: str) -> str:
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=_BUILDAH_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError as exc:
        raise ImageError(f"{what}: {argv[0]} is not installed (`make image` installs buildah)") from exc
    except subprocess.TimeoutExpired as exc:
        raise ImageError(f"{what} did not finish within {_BUILDAH_TIMEOUT_S:.0f} s") from exc
    if proc.returncode != 0:
        raise ImageError(f"{what} failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def base_image() -> str:
    """The Debian base of `make image` (built once by tools/image/base.sh), by name."""
    out = _run(["bash", str(REPO / "tools" / "image" / "base.sh")], "building the image's Debian base")
    return out.strip().splitlines()[-1]


def sandbox_image(base: str) -> str:
    """`base` whose command sleeps forever: the pods' sandbox (pause) image, made once."""
    name = "localhost/computedomains-sandbox:" + base.rsplit(":", 1)[-1]
    if (
        subprocess.run(
            ["buildah", "inspect", "--type", "image", name], capture_output=True, check=False
        ).returncode
        == 0
    ):
        return name
    container = _run(["buildah", "from", "--pull=never", base], f"buildah from {base}").strip()
    try:
        _run(
            [
                "buildah",
                "config",
                "--entrypoint",
                "[]",
                "--cmd",
                json.dumps(["sleep", "infinity"]),
                container,
            ],
            "configuring the sandbox image",
        )
        _run(["buildah", "commit", "--quiet", container, name], f"committing {name}")
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, check=False)
    return name


def export_archive(image: str, archive: Path) -> Path:
    """`image` from buildah's storage as a docker-archive file carrying its name."""
    _run(["buildah", "push", "--quiet", image, f"docker-archive:{archive}:{image}"], f"buildah push {image}")
    return archive


@dataclass(frozen=True)
class NodeImages:
    """The workload and sandbox images, by name, and their archives for `ctr images import`."""

    workload: str
    sandbox: str
    archives: tuple[Path, ...]


def prepare_images(work_dir: Path) -> NodeImages:
    work_dir.mkdir(parents=True, exist_ok=True)
    base = base_image()
    sandbox = sandbox_image(base)
    archives = (
        export_archive(base, work_dir / "workload.tar"),
        export_archive(sandbox, work_dir / "sandbox.tar"),
    )
    return NodeImages(workload=base, sandbox=sandbox, archives=archives)
