# The interface of the compiled token packer (_packtokens.pyx), for mypy and editors; `make lint`
# runs mypy's stubtest to check it against the built extension.
from array import array
from collections.abc import Sequence

def pack_tokens(arrays: Sequence[array[int]]) -> bytes: ...
def pack_hashes(hashes: list[int]) -> bytes: ...
