# The interface of the compiled gather reader (_gatherscan.pyx), for mypy and editors; `make lint`
# runs mypy's stubtest to check it against the built extension.
from array import array

__all__ = ["scan_body"]

def scan_body(
    body: bytes | bytearray | memoryview, offset: int
) -> (
    tuple[
        int,
        int,
        int,
        list[tuple[int, int]],
        int,
        int,
        array[int],
        array[int],
        array[int],
        array[int],
    ]
    | None
): ...
