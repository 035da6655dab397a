# The interface of the compiled gather reader (_gatherscan.pyx), for mypy and editors; `make lint`
# runs mypy's stubtest to check it against the built extension.
from array import array

__all__ = ["extend_shifted", "rank_tallies", "scan_body"]

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
def extend_shifted(dst: array[int], src: array[int], a: int, b: int, delta: int) -> None: ...
def rank_tallies(
    ranks: array[int], ids: array[int], a: int, b: int
) -> tuple[dict[int, int], dict[int, int]]: ...
