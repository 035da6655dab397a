"""Builds the optional compiled fast paths; everything else is in pyproject.toml.

Each extension is optional: when it cannot be built the package falls back to pure Python
(fastavro for the codec), slower but byte-for-byte the same.
"""

from pathlib import Path

from setuptools import Extension, setup

EXTENSIONS = [
    ("kvevents.schemas._fastcodec", "schemas/_fastcodec.pyx"),
    ("kvevents.consumer._indexcore", "consumer/_indexcore.pyx"),
    ("kvevents.producer._fastrecorder", "producer/_fastrecorder.pyx"),
]


def _extensions() -> list[Extension]:
    sources = [(name, path) for name, path in EXTENSIONS if Path(path).exists()]
    if not sources:
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    modules = [Extension(name, [path], optional=True, extra_compile_args=["-O3"]) for name, path in sources]
    return cythonize(
        modules, language_level=3, compiler_directives={"boundscheck": False, "wraparound": False}
    )


setup(ext_modules=_extensions())
