"""Drafters and router trained for a named target and shipped inside the package (whiflash_trt/assets/<target>/).

`whiflash-build --target smollm2-135m` uses them when no --ar-drafter / --dllm-drafter / --router is given, and the
default engine's cache folder carries their hash, so a package with retrained drafters never reuses an old engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from whiflash_trt.manifest import file_sha256

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class Bundle:
    eagle3: Path | None
    dflash: Path | None
    router: Path | None

    @property
    def files(self) -> list[Path]:
        out: list[Path] = []
        for folder in (self.eagle3, self.dflash):
            if folder is not None:
                out += sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors"))
        return out + ([self.router] if self.router is not None else [])

    def version(self) -> str:
        """Short content hash of the shipped files ('none' when nothing is shipped)."""
        files = self.files
        return file_sha256(files)[:10] if files else "none"


def bundled_for(target: str) -> Bundle:
    """The bundle of a named target (empty when the package ships none for it)."""
    folder = ASSETS / target
    def present(p: Path, marker: str) -> Path | None:
        return p if (p / marker).is_file() else None
    router = folder / "router.safetensors"
    return Bundle(present(folder / "eagle3", "config.json"), present(folder / "dflash", "config.json"),
                  router if router.is_file() else None)
