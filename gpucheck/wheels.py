"""The Python packages the GPU machine lacks, carried to it as wheels (it has no network).

``make gpu-check`` (``python -m gpucheck.wheels``), on a machine with the network: downloads the pinned wheels
(``wheels.txt``) for x86-64 CPython 3.12 into ``.gpucheck/wheels/``, checks that every requirement of each
is either carried or on the machine (``device-packages.txt``) and that the working tree plus the wheels fit
what travels (64 MiB), and prints the one command to run there. On the GPU machine the runner installs
them into a scratch path (``install``) before any check. Standard library and pip only.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FOLDER = ".gpucheck/wheels"
LIMIT = 64 << 20  # bytes: what travels to the GPU machine, working tree and wheels together
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
OVERRIDES = {"transformers"}  # carried although the machine has them: installed apart, put in front
DEADLINE_S = 480.0  # seconds the whole run may take (runner.DEADLINE_S)
TIMEOUT_S = 560  # the GPU machine's time limit for the command: the run's deadline plus start-up and slack


def target_flags() -> list[str]:
    flags = ["--only-binary=:all:", "--no-deps", "--python-version", PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_list(path: Path) -> list[str]:
    return [line.split("#")[0].strip() for line in path.read_text().splitlines() if line.split("#")[0].strip()]


def pins() -> dict[str, str]:
    """name -> version of every carried package (``wheels.txt``, ``name==version`` a line)."""
    return {normalise(p.split("==")[0]): p.split("==")[1] for p in read_list(HERE / "wheels.txt")}


def download(dest: Path) -> list[Path]:
    """The pinned wheels in ``dest`` (downloaded when missing; others removed)."""
    dest.mkdir(parents=True, exist_ok=True)
    wanted = pins()
    subprocess.run([sys.executable, "-m", "pip", "download", "-qq", "--disable-pip-version-check", *target_flags(),
                    "-d", str(dest), *(f"{n}=={v}" for n, v in wanted.items())], check=True)
    for wheel in dest.glob("*.whl"):
        name, version = _name_version(wheel)
        if wanted.get(name) != version:
            wheel.unlink()
    return sorted(dest.glob("*.whl"))


def _name_version(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return normalise(name), version


def _requirement_class() -> type:
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip always carries its own copy
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    return Requirement


def requires(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines, extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def unmet(wheels: list[Path], device: set[str]) -> list[str]:
    """Requirements of the carried wheels that neither the wheels nor the GPU machine meet."""
    requirement = _requirement_class()
    carried = dict(_name_version(w) for w in wheels)
    environment = {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "sys_platform": "linux",
                   "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
                   "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
    problems = []
    for wheel in wheels:
        for text in requires(wheel):
            req = requirement(text)
            if req.marker is not None and not req.marker.evaluate(environment):
                continue
            name = normalise(req.name)
            if name in carried:
                if req.specifier and not req.specifier.contains(carried[name], prereleases=True):
                    problems.append(f"{wheel.name} needs {req}; {carried[name]} is carried")
            elif name not in device:
                problems.append(f"{wheel.name} needs {req}: neither carried nor on the GPU machine")
    return problems


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of what travels besides carried paths: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    return sum((root / p).stat().st_size for p in out.decode().split("\0") if p and (root / p).is_file())


def commit(root: Path = ROOT) -> str:
    """This checkout's commit (``-dirty`` when the working tree differs), or ``unknown``."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_command(label: str) -> str:
    return f'python3 -m gpucheck --out "$OUT" --wheels {FOLDER} --commit {label}'


def install(wheels: list[Path], target: Path, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Install ``wheels`` into ``target`` for CPython 3.12 on x86-64 Linux, without the network and without
    their dependencies (each one carried is named in ``wheels.txt``)."""
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                           "--no-compile", "--no-cache-dir", "--upgrade", *target_flags(), "--target", str(target),
                           *map(str, wheels)], capture_output=True, text=True, timeout=timeout)


def is_override(wheel: Path) -> bool:
    return _name_version(wheel)[0] in OVERRIDES


def prepare() -> int:
    dest = ROOT / FOLDER
    wheels = download(dest)
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    tree = tree_bytes()
    problems = unmet(wheels, {normalise(n) for n in read_list(HERE / "device-packages.txt")})
    missing = set(pins()) - {_name_version(w)[0] for w in wheels}
    print(f"{len(wheels)} wheels in {FOLDER}: {wheel_bytes / 2**20:.2f} MiB; working tree {tree / 2**20:.2f} MiB; "
          f"together {(tree + wheel_bytes) / 2**20:.2f} MiB of {LIMIT >> 20} MiB")
    for problem in [*problems, *(f"{m}: pinned, not downloaded" for m in sorted(missing))]:
        print(f"  problem: {problem}")
    if problems or missing or tree + wheel_bytes > LIMIT:
        print("not ready: fix the problems above (wheels.txt pins what is carried)", file=sys.stderr)
        return 1
    print("\nOn the GPU machine (no network), from the repository root, with the working tree and "
          f"{FOLDER} copied there:")
    print(f"  command:    {device_command(commit())}")
    print(f'  copy along: ["{FOLDER}"] (ignored by git)')
    print(f"  time limit: {TIMEOUT_S} s (the run stops itself after {DEADLINE_S:.0f} s)")
    print("On a CUDA machine that has deploykit's dependencies: python3 -m gpucheck --out DIR")
    print("Without CUDA the same command runs the dry run (every step that needs no GPU).")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description="Prepare the wheels the GPU machine lacks; print its command.")
    parser.parse_args()
    sys.exit(prepare())


if __name__ == "__main__":
    main()
