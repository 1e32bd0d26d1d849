"""The bundled data files (`tandem/envs/data/*.txt`, one entry a line), read once."""

from functools import cache
from importlib.resources import files


@cache
def load_word_list(filename: str) -> tuple[str, ...]:
    """The non-empty, stripped lines of `data/<filename>`, in file order."""
    text = files("tandem.envs").joinpath("data", filename).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())
