"""The Dockerfile cannot be built here (no Docker, no NGC registry): check what can be checked.

Everything it COPYs exists, it installs the plugin with the pins of requirements/constraints.txt
(keeping the base image's torch), builds csrc/ as a required step, and its base image is an NGC
PyTorch tag whose stated torch/CUDA agree with the constraints' torch pin.
"""
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _constraint(name: str) -> str:
    for line in (REPO / "requirements/constraints.txt").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"{name} is not pinned in requirements/constraints.txt")


def test_every_copied_path_exists():
    copies = [shlex.split(args) for kind, args in _instructions() if kind == "COPY"]
    assert copies, "the Dockerfile copies nothing"
    for args in copies:
        sources = [a for a in args[:-1] if not a.startswith("--")]
        for source in sources:
            assert (REPO / source).exists(), f"Dockerfile COPYs {source!r}, which is not in the repository"
    copied = {s.rstrip("/") for args in copies for s in args[:-1]}
    # what setup.py needs to build the package and the extension
    assert {"setup.py", "megatron_xmod", "csrc", "requirements"} <= copied


def test_installs_with_the_pinned_constraints_and_builds_the_extension():
    runs = " ".join(args for kind, args in _instructions() if kind == "RUN")
    assert "requirements/constraints.txt" in runs
    # the constraints minus torch (the image's own build is kept), used by every pip install
    assert "grep -v '^torch==' requirements/constraints.txt > /tmp/constraints-ngc.txt" in runs
    installs = re.findall(r"pip install ([^&]*)", runs)
    assert installs and all("-c /tmp/constraints-ngc.txt" in i for i in installs), installs
    assert any("--no-build-isolation" in i and '".[train' in i for i in installs)  # setup.py imports torch
    envs = " ".join(args for kind, args in _instructions() if kind == "ENV")
    assert "XMOD_BUILD_CUDA_EXT=1" in envs  # a missing toolkit fails the build instead of skipping csrc/
    assert "import megatron_xmod._permute_cuda" in runs
    extras = re.search(r'"\.\[([a-z,]+)\]"', runs).group(1).split(",")
    setup = (REPO / "setup.py").read_text()
    for extra in extras:
        assert f'"{extra}":' in setup, f"extra {extra!r} is not defined in setup.py"


def test_base_image_is_ngc_pytorch_matching_the_torch_pin():
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), flags=re.M))
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3", args["BASE_IMAGE"]), args["BASE_IMAGE"]
    assert ("FROM", "${BASE_IMAGE}") in _instructions()
    torch_pin = _constraint("torch")
    major_minor = ".".join(torch_pin.split(".")[:2])
    text = DOCKERFILE.read_text()
    # the stated match and the build-time check follow the pin (update the tag when the pin moves)
    assert f"torch {torch_pin} built for CUDA 13" in text
    assert f"v.startswith('{major_minor}')" in text and "c.startswith('13')" in text
