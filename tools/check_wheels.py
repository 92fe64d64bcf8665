"""Check that a folder of wheels is complete for the GPU machine: python tools/check_wheels.py DIR.

Every Requires-Dist of every wheel (extras and markers that do not apply to CPython 3.12 on Linux left out)
must be met by a wheel in DIR or by a package the machine already has (PRESENT, read off the target CUDA image's
package list); no name twice, and nothing from REFUSED (it would shadow the machine's CUDA build).
"""

import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

# On the target CUDA image (python 3.12, torch 2.11.0+cu130), among others: what deepspeed, pydantic and this
# package ask for and the image holds.
PRESENT = {
    "torch", "numpy", "einops", "msgpack", "ninja", "psutil", "py-cpuinfo", "tqdm", "packaging", "nvidia-ml-py",
    "transformers", "huggingface-hub", "tokenizers", "safetensors", "regex", "pyyaml", "filelock", "fsspec",
    "requests", "typer", "hf-xet", "httpx"
}
REFUSED = {"torch", "numpy", "triton", "transformers"}
ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def requirements(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        metadata = Parser().parsestr(archive.read(name).decode())
    for line in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(ENVIRONMENT):
            yield requirement


def check(folder: Path):
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        return [f"no wheels in {folder}"]
    versions = {}
    problems = []
    for wheel in wheels:
        name, version, _, tags = parse_wheel_filename(wheel.name)
        if name in versions:
            problems.append(f"{name} twice: {versions[name]} and {version}")
        versions[name] = version
        if name in REFUSED:
            problems.append(f"{wheel.name}: {name} must not travel (the machine's own build would be shadowed)")
        if not any(t.interpreter in ("py3", "cp312") and t.platform in ("any", ) or t.interpreter == "cp312"
                   for t in tags):
            problems.append(f"{wheel.name}: not for CPython 3.12")
    for wheel in wheels:
        for requirement in requirements(wheel):
            name = canonicalize_name(requirement.name)
            if name in versions:
                if not requirement.specifier.contains(versions[name], prereleases=True):
                    problems.append(f"{wheel.name} needs {requirement}, the set has {name} {versions[name]}")
            elif name not in PRESENT:
                problems.append(f"{wheel.name} needs {requirement}: neither in the set nor on the machine")
    return problems


def main(argv):
    folder = Path(argv[1] if len(argv) > 1 else ".whl")
    problems = check(folder)
    for problem in problems:
        print(f"check_wheels: {problem}", file=sys.stderr)
    if not problems:
        total = sum(w.stat().st_size for w in folder.glob("*.whl"))
        print(f"check_wheels: {len(list(folder.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB, complete")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
