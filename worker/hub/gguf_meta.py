"""A GGUF file's metadata as plain Python values, with errors that name the file and the missing key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf


class GGUFConvertError(ValueError):
    """A GGUF file that cannot be turned into a Hugging Face checkpoint, with the reason."""


@dataclass(frozen=True)
class GGUFMetadata:
    """The metadata of one GGUF file by key (arrays as lists), and the file it came from."""

    path: Path
    fields: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.fields:
            raise GGUFConvertError(f"{self.path}: the GGUF metadata has no {key!r}")
        return self.fields[key]


def read_metadata(reader: gguf.GGUFReader, path: Path) -> GGUFMetadata:
    return GGUFMetadata(path, {name: field.contents() for name, field in reader.fields.items()})
