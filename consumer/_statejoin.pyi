# The interface of the compiled join (_statejoin.pyx), for mypy and editors; `make lint` runs
# mypy's stubtest to check it against the built extension.
from collections.abc import Iterable

def join_released(parts: Iterable[bytes]) -> bytes: ...
