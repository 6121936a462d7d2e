"""Start Triton Inference Server (the binary bundled with nvidia-pytriton) on a whiflash model repository.

What the bundled server needs, none of which pytriton's wheel sets up by itself outside pytriton:
- LD_LIBRARY_PATH with <site-packages>/nvidia_pytriton.libs (libtritonserver and its dependencies);
- a backend folder whose python/ holds libtriton_python.so, triton_python_backend_utils.py and the Python-backend
  stub built for this interpreter's version (the wheel ships one stub per version under python_backend_stubs/);
- this interpreter's environment first on PATH: the stub embeds libpython and finds its standard library and
  site-packages (torch, whiflash_trt) through the `python3` it sees on PATH and that venv's pyvenv.cfg.
The stub links the system's libpython3.X, so the environment must be a venv of the system Python
(scripts/setup_triton_env.sh makes one).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from whiflash_trt.errors import WhiflashError

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ServerOptions:
    model_repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    address: str = LOOPBACK
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise ValueError(f"{name.replace('_', '-')} must be in 1..65535, got {port}")
        if self.http_port == self.grpc_port:
            raise ValueError(f"http and grpc ports must differ, both are {self.http_port}")


@dataclass(frozen=True)
class TritonDistribution:
    """The server files inside an installed nvidia-pytriton."""
    root: Path          # .../site-packages/pytriton/tritonserver
    libs: Path          # .../site-packages/nvidia_pytriton.libs

    @property
    def server(self) -> Path:
        return self.root / "bin" / "tritonserver"

    def stub(self, version: str) -> Path:
        return self.root / "python_backend_stubs" / version / "triton_python_backend_stub"

    @classmethod
    def find(cls) -> "TritonDistribution":
        spec = importlib.util.find_spec("pytriton")
        if spec is None or spec.origin is None:
            raise WhiflashError("Triton Inference Server not found: this environment lacks nvidia-pytriton "
                                "(run scripts/setup_triton_env.sh and use .venv-triton/bin/whiflash-serve)")
        package = Path(spec.origin).parent
        dist = cls(root=package / "tritonserver", libs=package.parent / "nvidia_pytriton.libs")
        if not dist.server.is_file():
            raise WhiflashError(f"nvidia-pytriton at {package} has no bundled server ({dist.server} is missing)")
        return dist


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def prepare_backends(dist: TritonDistribution, folder: Path) -> Path:
    """A backend folder of links into the distribution plus this Python's stub; rebuilt each time (cheap)."""
    stub = dist.stub(python_version())
    if not stub.is_file():
        raise WhiflashError(f"nvidia-pytriton ships no Python-backend stub for Python {python_version()} ({stub})")
    python_dir = folder / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    links = {"triton_python_backend_stub": stub}
    for item in (dist.root / "backends" / "python").iterdir():
        if item.is_file():
            links[item.name] = item
    for name, target in links.items():
        tmp = python_dir / f".{name}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target)
        tmp.replace(python_dir / name)  # atomic: servers starting together never see a missing file
    return folder


def python_env_bin() -> Path:
    """The bin folder whose `python3` the stub must find: this interpreter's venv (or installation)."""
    return Path(sys.prefix) / "bin"


def server_command(dist: TritonDistribution, backends: Path, opts: ServerOptions) -> list[str]:
    return [str(dist.server),
            f"--model-repository={Path(opts.model_repository).resolve()}",
            f"--backend-directory={backends}",
            f"--http-address={opts.address}", f"--http-port={opts.http_port}",
            f"--grpc-address={opts.address}", f"--grpc-port={opts.grpc_port}",
            "--allow-metrics=false", "--allow-sagemaker=false", "--allow-vertex-ai=false",
            *opts.extra_args]


def server_environment(dist: TritonDistribution, base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(dist.libs), base.get("LD_LIBRARY_PATH", "")) if p)
    env["PATH"] = ":".join(p for p in (str(python_env_bin()), base.get("PATH", "")) if p)
    return env


def check_python() -> str | None:
    """A warning when this interpreter is not the system one the stub links against, else None."""
    if Path(sys.base_prefix).resolve() != Path("/usr"):
        return (f"this Python's base is {sys.base_prefix}, not the system Python (/usr) whose libpython the "
                f"Triton Python-backend stub links; models may fail to load (make the venv with "
                f"/usr/bin/python3.{sys.version_info.minor}, see scripts/setup_triton_env.sh)")
    return None


def exec_server(opts: ServerOptions, backends_dir: Path) -> None:
    """Replace this process with tritonserver (signals sent to it then reach the server directly)."""
    repo = Path(opts.model_repository)
    if not repo.is_dir():
        raise WhiflashError(f"model repository {repo} does not exist (write one with whiflash-build --triton-repo)")
    dist = TritonDistribution.find()
    backends = prepare_backends(dist, backends_dir)
    argv = server_command(dist, backends, opts)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, server_environment(dist, dict(os.environ)))
