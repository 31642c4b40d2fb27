"""Moving the image `make image` built (in buildah's storage) into a private docker engine."""

from __future__ import annotations

import subprocess

from tools.containers.engine import Engine, EngineError

BUILT_IMAGE = "localhost/computedomains:dev"  # tools/image/build.sh's default name
SCHEDULER_IMAGE = "localhost/computedomains-scheduler:dev"  # tools/image/scheduler.sh's
PUSH_TIMEOUT_S = 600.0


def load_built_image(engine: Engine, name: str, image: str = BUILT_IMAGE) -> None:
    """`image` from buildah's storage into `engine`, tagged `name` (by `docker load`, no registry)."""
    archive = engine.root / "image.tar"
    try:
        proc = subprocess.run(
            ["buildah", "push", "--quiet", image, f"docker-archive:{archive}:{name}"],
            capture_output=True,
            text=True,
            timeout=PUSH_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError as exc:
        raise EngineError("buildah is not installed: `make image` installs it and builds the image") from exc
    except subprocess.TimeoutExpired as exc:
        raise EngineError(f"buildah push {image} did not finish within {PUSH_TIMEOUT_S:.0f} s") from exc
    if proc.returncode != 0:
        raise EngineError(
            f"buildah push {image} failed ({(proc.stderr or proc.stdout).strip()}); build it with `make image`"
        )
    try:
        engine.run("load", "--quiet", "--input", str(archive), timeout_s=PUSH_TIMEOUT_S)
    finally:
        archive.unlink(missing_ok=True)
